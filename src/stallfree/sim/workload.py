"""Workloads for the simulator: real request traces (Azure LLM 2023, BurstGPT, generic CSV/JSONL),
synthetic arrivals (Poisson, Gamma) with length distributions, a shared-prefix synthetic workload, and
rate/window/head transforms.

Imports allowed: the standard library only.

Why one module of over 400 lines: the trace readers and the synthetic generator share the row
checks (_int_field, _float_field) and build the same Workload value, and synthetic lengths may be
drawn from a trace ("trace:PATH"); split apart, each half would import the other's internals.
"""

from __future__ import annotations

import csv
import datetime
import gzip
import io
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import IO

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, loads_line, open_text
from stallfree.core.errors import StallfreeError
from stallfree.core.request import MAX_TENANT_CHARS

__all__ = [
    "BUNDLED_TRACE",
    "LengthSpec",
    "TraceError",
    "TraceFileError",
    "Workload",
    "load_bundled",
    "load_mooncake",
    "load_trace",
    "parse_length_spec",
    "parse_shared_prefix",
    "shared_prefix",
    "synthetic",
]

#: The trace shipped in the package (Azure LLM inference trace 2023, conversation; see data/README.md).
BUNDLED_TRACE = "azure_conv_2023.csv.gz"
#: The Mooncake FAST'25 conversation trace shipped in the package, with prefix block ids (data/README.md).
MOONCAKE_TRACE = "mooncake_fast25_conversation.jsonl.gz"
#: Tokens per block of a Mooncake trace's hash_ids.
MOONCAKE_BLOCK = 512

# How many bad-row messages a skipping load keeps for its report.
_KEPT_MESSAGES = 5

#: How far an arrival time may lie from the trace's first one (in file order), s: 10^8 s, about 3.2
#: years. The longest public LLM traces span weeks to a few months (10^6-10^7 s); a time further out
#: is a typo or a unit error (ms or us read as s), and 1e308 would leave the simulated clock unable to
#: tell a step apart (it stands still past 2^53 s), giving figures such as a TTFT of 6 ms and a TPOT of
#: 0 that enter the averages. Within it, times relative to the start resolve to 15 ns.
MAX_ARRIVAL_SPAN_S = 1e8
#: The largest arrival time a trace may state at all, s: 10^12 s (about 31,700 years since its
#: epoch), which holds Unix times and Azure's wall clock (seconds since year 1, about 6.4e10) while
#: keeping their differences resolved to 0.1 ms or better.
MAX_ARRIVAL_S = 1e12


class TraceError(StallfreeError, ValueError):
    """A trace could not be read: a missing file, an unknown format, or a malformed row (the message
    starts with `path:line:` and names the field and the value)."""


class TraceFileError(TraceError):
    """The trace file itself is missing, a directory, or cannot be opened (the commands exit 2, as for
    any unusable command-line value, and as for a TraceError)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests to replay: per request an arrival time and its prompt and output lengths.

    Requests are in file order (stable-sorted by arrival); equal arrivals keep that order, which is
    the order the simulator adds them in.

    Attributes:
        arrivals: arrival time of each request, s, non-decreasing (traces start at 0).
        prompt_lens: prompt length of each request, tokens (>= 1).
        output_lens: tokens each request really generates (>= 1) before it stops by itself.
        name: a label for reports.
        skipped_rows: malformed rows skipped while loading (with skip_bad_rows).
        notes: lines for the report (what was skipped or excluded, and why).
        prefix_ids: None, or per request the ids of its prompt's blocks of `prefix_block` tokens
            (ceil(prompt_len / prefix_block) of them, the last one covering a partial block), equal
            ids meaning equal prefixes up to and including that block (Mooncake's hash_ids).
        prefix_block: tokens per block of prefix_ids.
        loras: None, or per request the name of its LoRA adapter (None: the base model); a trace's
            `lora` column or field (empty: the base model), or drawn (stallfree.sim.lora.assign_loras).
        tenants: None (no tenant column: every request the tenant "default"), or per request the
            client it is served for, None for "default" (a `tenant` CSV column or JSONL field; an
            empty value is "default"); read by SchedulerConfig(fairness="vtc") and `by_tenant`.

    Raises:
        ValueError: the three sequences differ in length, or a length is < 1.
    """

    arrivals: tuple[float, ...]
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    name: str = "workload"
    skipped_rows: int = 0
    notes: tuple[str, ...] = field(default=())
    prefix_ids: tuple[tuple[int, ...], ...] | None = None
    prefix_block: int = MOONCAKE_BLOCK
    loras: tuple[str | None, ...] | None = None
    tenants: tuple[str | None, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if self.tenants is not None and len(self.tenants) != n:
            raise ValueError(f"workload {self.name!r}: {n} arrivals, {len(self.tenants)} tenants")
        if self.loras is not None and len(self.loras) != n:
            raise ValueError(f"workload {self.name!r}: {n} arrivals, {len(self.loras)} loras")
        if len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError(
                f"workload {self.name!r}: {n} arrivals, {len(self.prompt_lens)} prompt_lens, "
                f"{len(self.output_lens)} output_lens"
            )
        if n and (min(self.prompt_lens) < 1 or min(self.output_lens) < 1):
            raise ValueError(f"workload {self.name!r}: every prompt_len and output_len must be >= 1")

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        """Time from the first to the last arrival, s (0 for fewer than 2 requests)."""
        return self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0

    @property
    def mean_rate(self) -> float:
        """Arrivals per second over the workload's span (inf when all arrive at once)."""
        d = self.duration
        return (len(self) - 1) / d if d > 0 else math.inf

    def scale_rate(self, factor: float) -> Workload:
        """Replay `factor` times faster: every arrival time divided by factor (> 0).

        Raises:
            ValueError: factor is not a finite number > 0.
        """
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"rate scale must be a finite number > 0, got {factor!r}")
        if factor == 1:
            return self
        return replace(self, arrivals=tuple(t / factor for t in self.arrivals))

    def window(self, start: float = 0.0, end: float = math.inf) -> Workload:
        """The requests arriving in [start, end) s, with times shifted so that `start` is 0.

        Raises:
            ValueError: end <= start or start < 0.
        """
        if start < 0 or end <= start:
            raise ValueError(f"time window needs 0 <= start < end, got start={start!r}, end={end!r}")
        idx = [i for i, t in enumerate(self.arrivals) if start <= t < end]
        return self._select(idx, shift=start)

    def head(self, n: int) -> Workload:
        """The first n requests (all of them when n >= len).

        Raises:
            ValueError: n < 1.
        """
        if n < 1:
            raise ValueError(f"number of requests must be >= 1, got {n!r}")
        return self._select(range(min(n, len(self))), shift=0.0)

    def _select(self, idx: range | list[int], shift: float) -> Workload:
        ids = self.prefix_ids
        return replace(
            self,
            arrivals=tuple(self.arrivals[i] - shift for i in idx),
            prompt_lens=tuple(self.prompt_lens[i] for i in idx),
            output_lens=tuple(self.output_lens[i] for i in idx),
            prefix_ids=tuple(ids[i] for i in idx) if ids is not None else None,
            loras=tuple(self.loras[i] for i in idx) if self.loras is not None else None,
            tenants=tuple(self.tenants[i] for i in idx) if self.tenants is not None else None,
        )

    def tenant(self, i: int) -> str | None:
        """Request i's tenant (None: "default")."""
        return self.tenants[i] if self.tenants is not None else None

    def block_hashes(self, i: int, block_size: int) -> tuple[tuple[int, int], ...] | None:
        """Request i's prompt as a scheduler's block hashes (prompt_len // block_size of them), or None
        when the workload has no prefix ids.

        Scheduler block j covers tokens [j*B, (j+1)*B), inside trace block j*B // prefix_block; its hash
        is (that trace block's id, j's position inside it), so two requests share scheduler block j
        exactly when they share the trace block that holds it. A prompt's last, partial trace block
        keeps its id: the full scheduler blocks inside it are shared only with requests that have the
        same id there; its tokens past the last full scheduler block are never cached.

        Raises:
            ValueError: block_size does not divide prefix_block.
        """
        ids = self.prefix_ids
        if ids is None:
            return None
        per = check_block_size(block_size, self.prefix_block)
        row = ids[i]
        return tuple((row[j // per], j % per) for j in range(self.prompt_lens[i] // block_size))

    def prefix_hit_bound(self, block_size: int) -> float | None:
        """The prefix cache hit rate an infinite cache would reach on this workload: hit prompt tokens /
        prompt tokens, each request hitting the longest prefix of its blocks seen in any earlier
        request (capped at prompt_len - 1 tokens, as the scheduler computes the last token), computed
        from the trace alone. None without prefix ids.

        Raises:
            ValueError: block_size does not divide prefix_block.
        """
        if self.prefix_ids is None:
            return None
        seen: set[tuple[int, int]] = set()
        hits = total = 0
        for i, plen in enumerate(self.prompt_lens):
            hashes = self.block_hashes(i, block_size) or ()
            h = 0
            cap = min(len(hashes), (plen - 1) // block_size)
            while h < cap and hashes[h] in seen:
                h += 1
            hits += h * block_size
            total += plen
            seen.update(hashes)
        return hits / total if total else 0.0


def check_block_size(block_size: int, prefix_block: int = MOONCAKE_BLOCK) -> int:
    """Return prefix_block // block_size when block_size (an integer >= 1) divides prefix_block.

    Raises:
        ValueError: otherwise; the message names both numbers.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or prefix_block % block_size:
        raise ValueError(
            f"block_size {block_size!r} must divide the trace's prefix block of {prefix_block} tokens "
            f"(1, 2, 4, ..., {prefix_block} for a power of two)"
        )
    return prefix_block // block_size


# ---------------------------------------------------------------------------------- traces


def load_bundled() -> Workload:
    """Load the bundled Azure LLM 2023 conversation trace (19,366 requests, about an hour)."""
    ref = resources.files("stallfree.sim").joinpath("data", BUNDLED_TRACE)
    with ref.open("rb") as raw:
        text = io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8", newline="")
        return _load_csv(text, "<bundled>/" + BUNDLED_TRACE, "azure", False, "azure-conv-2023")


def load_mooncake() -> Workload:
    """Load the bundled Mooncake FAST'25 conversation trace (12,031 requests, about an hour, with
    prefix block ids; data/README.md)."""
    ref = resources.files("stallfree.sim") / "data" / MOONCAKE_TRACE
    with ref.open("rb") as raw, io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8") as text:
        return _load_mooncake(text, "<bundled>/" + MOONCAKE_TRACE, False, "mooncake-fast25-conversation")


def load_trace(path: str | Path, fmt: str = "auto", skip_bad_rows: bool = False) -> Workload:
    """Load a request trace; `.gz` files are decompressed.

    Formats (fmt="auto" picks by extension, then by the CSV header):
        azure: Azure LLM inference trace 2023 CSV: TIMESTAMP (wall clock), ContextTokens, GeneratedTokens.
        burstgpt: BurstGPT CSV: Timestamp (s), Request tokens, Response tokens (other columns ignored;
            rows with 0 response tokens are failed requests in the trace: excluded and counted).
        csv: arrival_time (s), prompt_len, output_len; optionally lora (a LoRA adapter's name, empty:
            the base model) and tenant (the client's name; empty: "default").
        jsonl: one object per line with arrival_time, prompt_len, output_len and optionally lora (a
            string, or null or "" for the base model) and tenant (a string, or null for "default").
        mooncake: Mooncake's JSONL: timestamp (ms), input_length, output_length, hash_ids (one id
            per 512-token prompt block; equal ids, equal prefixes); auto picks it for a .jsonl whose
            first object has hash_ids and input_length.

    Args:
        path: the file.
        fmt: "auto", "azure", "burstgpt", "csv", "jsonl" or "mooncake".
        skip_bad_rows: skip and count malformed rows instead of raising at the first one.

    Raises:
        TraceFileError: the file is missing, a directory or cannot be opened.
        TraceError: the format is unknown, the contents cannot be decoded (not UTF-8, a corrupt or
            truncated gzip stream), the file or a line is past its limit (stallfree._files: 1 GiB
            decompressed, 1 MiB a line; never skipped), or (without skip_bad_rows) a row is
            malformed: "path:line: field value: reason" (a time not finite, negative, over
            MAX_ARRIVAL_S or more than MAX_ARRIVAL_SPAN_S from the first row's among them); also when
            no request is left.
    """
    p = Path(path)
    if p.is_dir():
        raise TraceFileError(f"trace {path} is a directory: give one trace file (CSV or JSONL, .gz allowed)")
    if not p.is_file():
        raise TraceFileError(f"trace file not found: {path}")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise TraceFileError(f"cannot open trace {path}: {exc.strerror or exc}") from None
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (expected auto, azure, burstgpt, csv, jsonl or mooncake)")
    name = p.name.removesuffix(".gz")
    if fmt == "auto" and name.endswith((".jsonl", ".json")):
        fmt = "jsonl"
        try:
            with open_text(p) as fh:
                first = next((ln for ln in bounded_lines(fh, path) if ln.strip()), "")
            obj = loads_line(first)
            if isinstance(obj, dict) and "hash_ids" in obj and "input_length" in obj:
                fmt = "mooncake"
        except READ_ERRORS:
            pass  # the jsonl reader reports it
        except ValueError:
            pass  # likewise
    try:
        with open_text(p) as fh:
            if fmt == "mooncake":
                return _load_mooncake(fh, str(path), skip_bad_rows, name)
            if fmt == "jsonl":
                return _load_jsonl(fh, str(path), skip_bad_rows, name)
            return _load_csv(fh, str(path), fmt, skip_bad_rows, name)
    except FileLimitError as exc:
        raise TraceError(f"trace {exc}") from None
    except READ_ERRORS as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None


#: The values of load_trace(fmt=...).
TRACE_FORMATS = ("auto", "azure", "burstgpt", "csv", "jsonl", "mooncake")


def _load_mooncake(fh: IO[str], path: str, skip: bool, name: str) -> Workload:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (ceil(input / 512))."""
    rows = _Rows(path, skip)
    ids: list[tuple[int, ...]] = []
    for line, text in enumerate(bounded_lines(fh, path), start=1):
        if not text.strip():
            continue
        try:
            obj = loads_line(text)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in obj:
                    raise ValueError(f"missing field {key!r}")
            t = rows.time(_float_field("timestamp", str(obj["timestamp"])) / 1000.0, "timestamp",
                          str(obj["timestamp"]), line)
            plen = _int_field("input_length", str(obj["input_length"]), 1)
            olen = _int_field("output_length", str(obj["output_length"]), 1)
            hid = obj["hash_ids"]
            if not isinstance(hid, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in hid):
                raise ValueError(f"hash_ids must be a list of integers, got {str(hid)[:60]}")
            want = -(-plen // MOONCAKE_BLOCK)
            if len(hid) != want:
                raise ValueError(
                    f"hash_ids has {len(hid)} ids, expected ceil(input_length / {MOONCAKE_BLOCK}) = "
                    f"ceil({plen} / {MOONCAKE_BLOCK}) = {want}"
                )
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            rows.error(line, str(exc))
            continue
        rows.rows.append((t, plen, olen))
        ids.append(tuple(hid))
    order = sorted(range(len(ids)), key=lambda k: rows.rows[k][0])
    wl = rows.finish(name)
    # finish() stable-sorts by arrival and shifts to 0; carry the ids in the same order.
    return replace(wl, prefix_ids=tuple(ids[k] for k in order))


_HEADERS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "csv": ("arrival_time", "prompt_len", "output_len"),
}


class _Rows:
    """Collects parsed rows, counting or raising on bad ones."""

    def __init__(self, path: str, skip: bool) -> None:
        self.path, self.skip = path, skip
        self.rows: list[tuple[float, int, int]] = []
        self.loras: dict[int, str] = {}  # row index -> its LoRA adapter (rows without one: the base model)
        self.tenants: list[str | None] | None = None  # per row, when the trace has a tenant column
        self.bad = 0
        self.messages: list[str] = []
        self.excluded = 0
        self.first: tuple[float, int] | None = None  # the first accepted row's time, s, and line

    def time(self, t: float, field_name: str, text: str, line: int) -> float:
        """Return t (s, already finite and >= 0), or raise ValueError when it is past MAX_ARRIVAL_S
        or more than MAX_ARRIVAL_SPAN_S from the first accepted row's time (which it becomes when
        it is the first)."""
        if t > MAX_ARRIVAL_S:
            raise ValueError(f"{field_name} {text!r} is past {MAX_ARRIVAL_S:g} s (a trace's times must lie "
                             "within about 31,700 years of its epoch)")
        if self.first is None:
            self.first = (t, line)
        elif abs(t - self.first[0]) > MAX_ARRIVAL_SPAN_S:
            raise ValueError(
                f"{field_name} {text!r} is {abs(t - self.first[0]):.3g} s from the first row's (line "
                f"{self.first[1]}); arrival times must lie within {MAX_ARRIVAL_SPAN_S:g} s (about 3.2 years) "
                "of it"
            )
        return t

    def error(self, line: int, message: str) -> None:
        text = f"{self.path}:{line}: {message}"
        if not self.skip:
            raise TraceError(text)
        self.bad += 1
        if len(self.messages) < _KEPT_MESSAGES:
            self.messages.append(text)

    def finish(self, name: str) -> Workload:
        if not self.rows:
            raise TraceError(f"{self.path}: no requests in the trace")
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i][0])  # stable: equal arrivals keep file order
        rows = [self.rows[i] for i in order]
        tenants = tuple(self.tenants[i] for i in order) if self.tenants is not None else None
        t0 = rows[0][0]
        notes = []
        # The event loop takes requests in arrival order, so a trace out of order is sorted, not refused;
        # say so, since a file whose clock goes backwards may be a merge of two traces.
        latest, back = -math.inf, 0
        for r in self.rows:
            back += r[0] < latest
            latest = max(latest, r[0])
        if back:
            notes.append(f"sorted by arrival time: {back} of {len(self.rows)} rows arrive earlier than a row "
                         "above them in the file")
        if self.bad:
            notes.append(f"skipped {self.bad} malformed rows; first: {self.messages[0]}")
        if self.excluded:
            notes.append(f"excluded {self.excluded} rows with 0 output tokens (failed in the trace)")
        loras = None
        if self.loras:
            order = sorted(range(len(self.rows)), key=lambda k: self.rows[k][0])
            loras = tuple(self.loras.get(k) for k in order)
        return Workload(
            arrivals=tuple(r[0] - t0 for r in rows),
            prompt_lens=tuple(r[1] for r in rows),
            output_lens=tuple(r[2] for r in rows),
            name=name,
            skipped_rows=self.bad,
            notes=tuple(notes),
            loras=loras,
            tenants=tenants,
        )

    def add(self, row: tuple[float, int, int], tenant: str | None, has_tenant: bool) -> None:
        """Keep a parsed row (and its tenant when the trace has a tenant column or field)."""
        if has_tenant and self.tenants is None:
            self.tenants = [None] * len(self.rows)
        self.rows.append(row)
        if self.tenants is not None:
            self.tenants.append(tenant)


def _tenant_field(value: object) -> str | None:
    """A trace's tenant value: None for null or empty (the tenant "default"), else the stripped name.

    Raises:
        ValueError: not a string (nor null), or longer than MAX_TENANT_CHARS characters.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"tenant {value!r} is not a string")
    text = value.strip()
    if len(text) > MAX_TENANT_CHARS:
        raise ValueError(f"tenant {text[:40]!r}... is longer than {MAX_TENANT_CHARS} characters")
    return text or None


def _int_field(field_name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{field_name} {text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{field_name} {text!r} must be >= {minimum}")
    return value


def _float_field(field_name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{field_name} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{field_name} {text!r} must be a finite number >= 0")
    return value


_DAYS: dict[str, int] = {}


def _wall_clock(text: str) -> float:
    """Seconds since 0001-01-01 of 'YYYY-MM-DD HH:MM:SS[.fffffff]' (7 fractional digits in Azure's)."""
    try:
        day = _DAYS.get(text[:10])
        if day is None:
            day = _DAYS.setdefault(text[:10], datetime.date.fromisoformat(text[:10]).toordinal())
        if text[10] not in " T" or text[13] != ":" or text[16] != ":":
            raise ValueError
        secs = int(text[11:13]) * 3600 + int(text[14:16]) * 60 + float(text[17:])
    except (ValueError, IndexError):
        raise ValueError(f"TIMESTAMP {text!r} is not a 'YYYY-MM-DD HH:MM:SS.fff' time") from None
    return day * 86400.0 + secs


def _load_csv(fh: IO[str], path: str, fmt: str, skip: bool, name: str) -> Workload:
    reader = csv.reader(bounded_lines(fh, path))
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: cannot read the header: {exc}") from None
    if header is None:
        raise TraceError(f"{path}: empty file")
    header = [h.strip() for h in header]
    if fmt == "auto":
        fmt = next((f for f, cols in _HEADERS.items() if set(cols) <= set(header)), "")
        if not fmt:
            raise TraceError(
                f"{path}:1: unrecognised header {header}; expected the columns of one of: "
                + "; ".join(f"{f} ({', '.join(c)})" for f, c in _HEADERS.items())
            )
    cols = _HEADERS[fmt]
    missing = [c for c in cols if c not in header]
    if missing:
        hint = "; the file looks like JSON lines: use `trace_format`='jsonl'" if header[0].startswith("{") else ""
        raise TraceError(
            f"{path}:1: a {fmt} trace needs the column(s) {', '.join(cols)}; {missing} missing from "
            f"the header {header}{hint}"
        )
    ia, ip, io_ = (header.index(c) for c in cols)
    il = header.index("lora") if "lora" in header else -1  # optional: a request's LoRA adapter
    it = header.index("tenant") if fmt == "csv" and "tenant" in header else -1
    width = len(header)
    rows = _Rows(path, skip)
    min_out = 0 if fmt == "burstgpt" else 1
    while True:
        try:
            row = next(reader, None)
        except csv.Error as exc:  # a field over the csv module's 128 KiB, a stray quote: a malformed row
            rows.error(reader.line_num, str(exc))
            continue
        if row is None:
            break
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        try:
            if len(row) != width:
                raise ValueError(f"expected {width} fields, got {len(row)}")
            t = _wall_clock(row[ia].strip()) if fmt == "azure" else _float_field(cols[0], row[ia])
            t = rows.time(t, cols[0], row[ia].strip(), line)
            plen = _int_field(cols[1], row[ip].strip(), 1)
            olen = _int_field(cols[2], row[io_].strip(), min_out)
            tenant = _tenant_field(row[it]) if it >= 0 else None
        except ValueError as exc:
            rows.error(line, str(exc))
            continue
        if olen == 0:
            rows.excluded += 1
            continue
        if il >= 0 and row[il].strip():
            rows.loras[len(rows.rows)] = row[il].strip()
        rows.add((t, plen, olen), tenant, it >= 0)
    return rows.finish(name)


def _load_jsonl(fh: IO[str], path: str, skip: bool, name: str) -> Workload:
    rows = _Rows(path, skip)
    for line, text in enumerate(bounded_lines(fh, path), start=1):
        if not text.strip():
            continue
        try:
            try:
                obj = loads_line(text)
            except json.JSONDecodeError:
                if not rows.rows and line == 1:
                    # The very first line is not JSON: the wrong format, not a bad row.
                    raise TraceError(
                        f"{path}:1: not a jsonl trace (one JSON object per line with arrival_time, "
                        f"prompt_len, output_len); the first line is {text.strip()[:80]!r}"
                        + ("; for a CSV use `trace_format`='csv' or auto" if "," in text else "")
                    ) from None
                raise
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            for key in ("arrival_time", "prompt_len", "output_len"):
                if key not in obj:
                    raise ValueError(f"missing field {key!r}")
            t = rows.time(_float_field("arrival_time", str(obj["arrival_time"])), "arrival_time",
                          str(obj["arrival_time"]), line)
            plen = _int_field("prompt_len", str(obj["prompt_len"]), 1)
            olen = _int_field("output_len", str(obj["output_len"]), 1)
            lora = obj.get("lora")
            if lora is not None and not isinstance(lora, str):
                raise ValueError(f"lora must be a string (an adapter's name) or null, got {str(lora)[:60]}")
            tenant = _tenant_field(obj.get("tenant"))
        except TraceError:
            raise
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            rows.error(line, str(exc))
            continue
        if lora:
            rows.loras[len(rows.rows)] = lora
        rows.add((t, plen, olen), tenant, "tenant" in obj)
    return rows.finish(name)


# ------------------------------------------------------------------------------- synthetic


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token-length distribution: fixed, uniform (inclusive), lognormal (by median and sigma,
    capped at `hi`), or resampled from a trace (`path` None means the bundled one).

    Build one with parse_length_spec().
    """

    kind: str
    lo: float = 0.0
    hi: float = 0.0
    path: str | None = None

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.lo:g}"
        if self.kind == "trace":
            return "trace" + (f":{self.path}" if self.path else "")
        return f"{self.kind}:{self.lo:g},{self.hi:g}"


# The longest length a distribution may name, tokens: beyond any model context, far below float overflow.
MAX_LENGTH = 10_000_000


def parse_length_spec(text: str) -> LengthSpec:
    """Parse "fixed:N", "uniform:LO,HI", "lognormal:MEDIAN,SIGMA", "trace" or "trace:PATH".

    Raises:
        ValueError: an unknown kind or a bad number; the message quotes the text.
    """
    kind, _, rest = text.strip().partition(":")
    try:
        nums = [float(x) for x in rest.split(",")] if rest and kind != "trace" else []
    except ValueError:
        raise ValueError(f"bad length distribution {text!r}: {rest!r} is not a list of numbers") from None
    if any(not math.isfinite(x) or x > MAX_LENGTH for x in nums):
        raise ValueError(f"bad length distribution {text!r}: numbers must be finite and at most {MAX_LENGTH:,}")
    if kind == "lognormal" and len(nums) == 2 and nums[1] > 10:
        raise ValueError(f"bad length distribution {text!r}: a lognormal sigma above 10 overflows")
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
        return LengthSpec("fixed", nums[0], nums[0])
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
        return LengthSpec("uniform", nums[0], nums[1])
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        return LengthSpec("lognormal", nums[0], nums[1])
    if kind == "trace":
        return LengthSpec("trace", path=rest or None)
    raise ValueError(
        f"bad length distribution {text!r}; expected fixed:N, uniform:LO,HI (1 <= LO <= HI), "
        "lognormal:MEDIAN,SIGMA (MEDIAN >= 1, SIGMA >= 0), trace or trace:PATH"
    )


def _trace_pairs(spec: LengthSpec) -> list[tuple[int, int]]:
    wl = load_trace(spec.path) if spec.path else load_bundled()
    return list(zip(wl.prompt_lens, wl.output_lens, strict=True))


def _sample_lengths(spec: LengthSpec, rng: random.Random, n: int, which: int) -> list[int]:
    if spec.kind == "fixed":
        return [int(spec.lo)] * n
    if spec.kind == "uniform":
        return [rng.randint(int(spec.lo), int(spec.hi)) for _ in range(n)]
    if spec.kind == "lognormal":
        mu = math.log(spec.lo)
        return [max(1, round(rng.lognormvariate(mu, spec.hi))) for _ in range(n)]
    pairs = _trace_pairs(spec)
    return [rng.choice(pairs)[which] for _ in range(n)]


def _gaps(rng: random.Random, n: int, rate: float, arrival: str, burstiness: float) -> Iterator[float]:
    if arrival == "poisson":
        for _ in range(n):
            yield rng.expovariate(rate)
    else:
        # Gamma gaps with shape k = burstiness and mean 1/rate: CV^2 = 1/k, so k = 1 is Poisson
        # and k < 1 is burstier (the burstiness factor of vLLM's serving benchmark).
        scale = 1.0 / (rate * burstiness)
        for _ in range(n):
            yield rng.gammavariate(burstiness, scale)


def synthetic(
    num_requests: int,
    rate: float,
    prompt_len: LengthSpec,
    output_len: LengthSpec,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Draw a synthetic workload: the first request at 0 s, then random gaps.

    When both lengths are `trace` specs of the same trace, (prompt, output) pairs are resampled
    together, keeping their correlation; otherwise each is drawn on its own.

    Args:
        num_requests: requests to draw, >= 1.
        rate: mean arrivals per second, > 0.
        prompt_len: prompt length distribution, tokens.
        output_len: output length distribution, tokens.
        arrival: "poisson" (exponential gaps) or "gamma" (Gamma gaps of shape `burstiness`).
        burstiness: Gamma shape, > 0 (1 = Poisson, < 1 burstier); ignored for poisson.
        seed: seed of the random.Random that draws everything (same seed, same workload).

    Raises:
        ValueError: a count, rate or burstiness out of range, or an unknown arrival process.
        TraceError: a `trace:PATH` length spec names an unreadable trace.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (requests/s), got {rate!r}")
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    rng = random.Random(seed)
    gaps = list(_gaps(rng, num_requests - 1, rate, arrival, burstiness))
    arrivals = [0.0]
    for g in gaps:
        arrivals.append(arrivals[-1] + g)
    if prompt_len.kind == "trace" and output_len.kind == "trace" and prompt_len.path == output_len.path:
        pairs = _trace_pairs(prompt_len)
        drawn = [rng.choice(pairs) for _ in range(num_requests)]
        prompts, outputs = [p for p, _ in drawn], [o for _, o in drawn]
    else:
        prompts = _sample_lengths(prompt_len, rng, num_requests, 0)
        outputs = _sample_lengths(output_len, rng, num_requests, 1)
    label = f"{arrival}(rate={rate:g}" + (f", burstiness={burstiness:g}" if arrival == "gamma" else "")
    return Workload(
        arrivals=tuple(arrivals),
        prompt_lens=tuple(prompts),
        output_lens=tuple(outputs),
        name=f"{label}; prompt {prompt_len}; output {output_len}; seed {seed})",
    )


def parse_shared_prefix(text: str) -> tuple[int, int, int, int]:
    """Parse "G,P,S,Q" (groups, prompts per group, system prompt tokens, question tokens).

    Raises:
        ValueError: not four integers, G, P, Q >= 1 and S >= 0; the message quotes the text.
    """
    try:
        g, p, s, q = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"`shared_prefix` wants GROUPS,PROMPTS,SYSTEM_TOKENS,QUESTION_TOKENS, got {text!r}") from None
    if g < 1 or p < 1 or s < 0 or q < 1 or s + q > MAX_LENGTH or g * p > 5_000_000:
        raise ValueError(f"`shared_prefix` {text!r}: needs GROUPS >= 1, PROMPTS >= 1, SYSTEM_TOKENS >= 0, "
                         f"QUESTION_TOKENS >= 1, at most 5,000,000 prompts and {MAX_LENGTH:,} tokens per prompt")
    return g, p, s, q


def shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: LengthSpec,
    rate: float,
    block: int = 16,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Draw a shared-prefix workload: `num_groups` groups of `prompts_per_group` prompts; every prompt of a
    group starts with the group's system prompt of `system_len` tokens and ends with its own question of
    `question_len` tokens (prompt_len = system_len + question_len), as the shared-prefix benchmarks of
    inference-perf (`shared_prefix`) and SGLang (`generated-shared-prefix`) build them. The prompts are
    shuffled across groups (seeded) and arrive at `rate`.

    The workload carries prefix ids of `block` tokens (Workload.prefix_ids, prefix_block = block): a block
    that holds system tokens only has its group's id for that position; a block that holds any question
    token is the request's own. So prefix caching (a paged scheduler with block_size dividing `block`) can
    hit the system prompt's full blocks, floor(system_len / block) x block tokens, in every prompt but the
    first of its group.

    Args:
        num_groups, prompts_per_group: G >= 1, P >= 1.
        system_len: S tokens, >= 0; question_len: Q tokens, >= 1.
        output_len: output length distribution, tokens (e.g. fixed:O).
        rate: mean arrivals per second, > 0; arrival, burstiness: as in synthetic().
        block: tokens per prefix block, >= 1 (the scheduler's block_size or a multiple of it).
        seed: seeds the shuffle, the gaps and the output lengths.

    Raises:
        ValueError: a count, length, rate or block out of range.
    """
    for name, v, lo in (("num_groups", num_groups, 1), ("prompts_per_group", prompts_per_group, 1),
                        ("system_len", system_len, 0), ("question_len", question_len, 1), ("block", block, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"shared prefix: {name} must be an integer >= {lo}, got {v!r}")
    base = synthetic(num_groups * prompts_per_group, rate, LengthSpec("fixed", 1, 1), output_len, arrival,
                     burstiness, seed)
    rng = random.Random(seed + 1)
    order = [g for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    plen = system_len + question_len
    nblocks = -(-plen // block)
    shared_blocks = system_len // block
    ids: list[tuple[int, ...]] = []
    next_own = num_groups * shared_blocks
    for g in order:
        row = [g * shared_blocks + j for j in range(shared_blocks)]
        row += range(next_own, next_own + nblocks - shared_blocks)
        next_own += nblocks - shared_blocks
        ids.append(tuple(row))
    name = (f"shared-prefix(groups={num_groups}, prompts={prompts_per_group}, system={system_len}, "
            f"question={question_len}; output {output_len}; rate={rate:g}; seed {seed})")
    return replace(base, prompt_lens=(plen,) * len(order), prefix_ids=tuple(ids), prefix_block=block, name=name)
