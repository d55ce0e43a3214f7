"""Measured steps: reading a step CSV (read_steps_csv), the error summary (ErrorStats) and the seeded
split into fitting and held-out rows.

Imports allowed: the standard library and stallfree.costmodel.errors.

Step CSV columns (header names; order free):
    num_tokens           tokens in the step (required)
    num_decodes          decodes in the step (required)
    decode_context_sum   sum over the decodes of the tokens already in their KV cache (required)
    seconds              the measured step time, seconds (required)
    num_prefill_tokens   prompt tokens in the step (default num_tokens - num_decodes)
    prefill_context_sum  sum over the prefill chunks of their start (default 0)
    num_sampled          tokens that sample (default num_decodes)
    step                 ignored (any other column is ignored too)
The attention pairs of the prefill part are worked out as if it were one chunk (exact when it is):
P x p + P(P + 1)/2 for P prefill tokens at offset p = prefill_context_sum.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, duplicated_column, open_text
from stallfree.costmodel.errors import CostModelDataError, CostModelError, CostModelFileError

__all__ = ["BUCKETS", "ErrorStats", "MeasuredStep", "check_fitting_rows", "read_steps_csv", "split_rows"]

#: Token-count buckets of the error report: (label, fewest tokens, most tokens).
BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("<=64", 1, 64),
    ("65-512", 65, 512),
    (">512", 513, float("inf")),
)


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One measured step: its token counts (tokens) and its time (seconds)."""

    num_tokens: int
    num_decodes: int
    decode_context_sum: int
    seconds: float
    num_prefill_tokens: int = 0
    prefill_context_sum: int = 0
    num_sampled: int | None = None

    def counts(self) -> tuple[int, float, float, int]:
        """Return (tokens, attention pairs, cached tokens read, sampled tokens) for CostModel.components."""
        nd, p_tok = self.num_decodes, self.num_prefill_tokens
        dec_tok = self.num_tokens - p_tok
        pairs = float(p_tok * self.prefill_context_sum + p_tok * (p_tok + 1) / 2)
        if nd:
            k = dec_tok / nd
            pairs += k * self.decode_context_sum + dec_tok * (k + 1) / 2
        sampled = nd if self.num_sampled is None else self.num_sampled
        return self.num_tokens, pairs, float(self.decode_context_sum + self.prefill_context_sum), sampled

    def sequences(self) -> int:
        """Return the sequences in the step: every decode, plus one for the prefill part (if any)."""
        return self.num_decodes + (1 if self.num_prefill_tokens else 0)

    def kind(self) -> str:
        """Return 'decode' (decodes only), 'prefill' (prompt tokens only) or 'mixed'."""
        if not self.num_prefill_tokens:
            return "decode"
        return "prefill" if not self.num_decodes else "mixed"

    def bucket(self) -> str:
        """Return the label of the BUCKETS entry that holds num_tokens."""
        for label, lo, hi in BUCKETS:
            if lo <= self.num_tokens <= hi:
                return label
        return BUCKETS[0][0]


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Absolute relative errors |predicted - measured| / measured over some rows (fractions, not %)."""

    rows: int
    mean: float
    median: float
    p90: float
    max: float

    @staticmethod
    def of(errors: Sequence[float]) -> ErrorStats:
        """Summarise a list of absolute relative errors."""
        e = sorted(errors)
        if not e:
            return ErrorStats(0, 0.0, 0.0, 0.0, 0.0)
        return ErrorStats(
            len(e), sum(e) / len(e), e[len(e) // 2], e[min(len(e) - 1, int(0.9 * len(e)))], e[-1]
        )

    def as_dict(self) -> dict[str, float | None]:
        """Return the figures as a dict (rows, mean, median, p90, max); the figures are None over no rows
        (an error of 0 would claim a perfect fit of rows there are none of)."""
        if not self.rows:
            return {"rows": 0, "mean": None, "median": None, "p90": None, "max": None}
        return {"rows": self.rows, "mean": self.mean, "median": self.median, "p90": self.p90, "max": self.max}


def split_rows(n: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """Split row indices 0..n-1 into (fitting, held-out) by a seeded shuffle; at least one held out.

    Raises:
        CostModelError: holdout outside (0, 1).
    """
    if not 0 < holdout < 1:
        raise CostModelError(f"holdout must be in (0, 1), got {holdout!r}")
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_test = max(1, round(n * holdout))
    return sorted(idx[n_test:]), sorted(idx[:n_test])


def check_fitting_rows(n_fit: int, n: int, params: int, least: int, holdout: float, what: str) -> None:
    """Refuse a split (split_rows) that leaves fewer than `least` of `n` rows to fit `params` parameters to.

    Args:
        n_fit: the fitting rows split_rows left; n: all rows; what: the rows, as the message names them
            ("measured steps").
        holdout: the fraction held out (--holdout), for the message.

    Raises:
        CostModelError: too few rows in all (fewer than least + 1: one row is always held out), or enough
            rows but a --holdout that holds out too many (the message gives the largest that leaves enough).
    """
    if n_fit >= least:
        return
    if n < least + 1:
        raise CostModelError(f"need at least {least + 1} {what} to fit {params} parameters, got {n}")
    # Any fraction up to (n - least) / n rounds to at most n - least rows held out; two decimals, rounded down.
    most = math.floor((n - least) / n * 100) / 100
    lower = f"--holdout {most:g} or less" if most >= 0.01 else "a smaller --holdout"
    raise CostModelError(f"--holdout {holdout:g} holds out {n - n_fit} of the {n} {what} and leaves {n_fit} to fit "
                         f"{params} parameters, which needs at least {least}: give {lower}")


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Read a CSV (or .csv.gz) file into its header and rows.

    Raises:
        CostModelFileError: the file is missing, a directory or cannot be opened (the message says
            'cannot read', the path and the reason).
        CostModelDataError: it opens but cannot be parsed (not UTF-8, not gzip or a corrupt gzip
            stream, bad CSV quoting, a field over the csv module's 128 KiB), or it is past the limits
            of stallfree._files (1 GiB decompressed, 1 MiB a line).
    """
    try:
        f = open_text(path, encoding="utf-8")
    except FileLimitError as exc:
        raise CostModelDataError(f"cannot read {exc}") from None
    except OSError as exc:
        raise CostModelFileError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        with f:
            reader = csv.DictReader(bounded_lines(f, path))
            twice = duplicated_column(reader.fieldnames)
            if twice is not None:
                raise CostModelDataError(
                    f"{str(path)!r}: column {twice!r} appears twice in the header; give each column once"
                )
            rows = list(reader)
            return list(reader.fieldnames or ()), rows
    except FileLimitError as exc:
        raise CostModelDataError(f"cannot read {exc}") from None
    except READ_ERRORS as exc:
        raise CostModelDataError(f"cannot read {str(path)!r}: {exc}") from None
    except csv.Error as exc:
        raise CostModelDataError(f"cannot read {str(path)!r}: {exc}") from None


def _cell(where: str, row: dict[str, str], col: str, default: float | None, integer: bool) -> Any:
    """Return one CSV cell as an int (or a float) >= 0; seconds must be > 0."""
    raw = row.get(col)
    if raw is None or raw == "":
        if default is None:
            raise CostModelDataError(f"{where}: column {col!r} is empty")
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        raise CostModelDataError(f"{where}: column {col!r} is not a number: {raw!r}") from None
    # Finite, and below 1e12 (tokens or seconds): a measured step never comes near it.
    if not 0 <= value < 1e12 or (col == "seconds" and not value > 0):
        raise CostModelDataError(f"{where}: column {col!r} out of range: {raw!r}")
    return value


def read_steps_csv(path: str | Path) -> list[MeasuredStep]:
    """Read measured steps from a CSV with the columns of the module docstring.

    Raises:
        CostModelFileError: the file is missing or cannot be opened.
        CostModelDataError: it cannot be parsed, a required column is missing (named), or a value is
            not a number or out of range (the row and column are named).
    """
    p = Path(path)
    header, rows = read_rows(p)
    for col in ("num_tokens", "num_decodes", "decode_context_sum", "seconds"):
        if col not in header:
            raise CostModelDataError(f"{str(p)!r}: missing column {col!r} (have: {', '.join(header)})")
    out = []
    for i, row in enumerate(rows, start=2):
        where = f"{str(p)!r} line {i}"

        def num(
            col: str,
            default: float | None = None,
            integer: bool = True,
            row: dict[str, str] = row,
            at: str = where,
        ) -> Any:
            return _cell(at, row, col, default, integer)

        tokens, nd = num("num_tokens"), num("num_decodes")
        prefill = num("num_prefill_tokens", tokens - nd)
        if prefill < 0 or prefill > tokens or nd > tokens - prefill:
            raise CostModelDataError(
                f"{where}: num_decodes {nd} + num_prefill_tokens {prefill} exceed num_tokens {tokens}"
            )
        sampled = row.get("num_sampled")
        out.append(
            MeasuredStep(
                num_tokens=tokens,
                num_decodes=nd,
                decode_context_sum=num("decode_context_sum"),
                seconds=num("seconds", integer=False),
                num_prefill_tokens=prefill,
                prefill_context_sum=num("prefill_context_sum", 0),
                num_sampled=num("num_sampled") if sampled else None,
            )
        )
    if not out:
        raise CostModelDataError(f"{str(p)!r} holds no rows")
    return out
