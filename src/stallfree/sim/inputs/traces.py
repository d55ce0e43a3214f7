"""Trace readers: the bundled Azure LLM inference trace 2023 and Mooncake FAST'25 conversation trace, Azure
and BurstGPT files, and generic CSV/JSONL with arrival_time, prompt_len and output_len, each read into a
Workload with its limits checked row by row.

Imports allowed: the standard library, stallfree._files and stallfree.sim.inputs.workload.
"""

from __future__ import annotations

import csv
import datetime
import gzip
import io
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import IO

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, duplicated_column, loads_line, open_text
from stallfree.core.request import MAX_TENANT_CHARS
from stallfree.sim.inputs.workload import (
    MAX_ARRIVAL_S,
    MAX_ARRIVAL_SPAN_S,
    MOONCAKE_BLOCK,
    TraceError,
    TraceFileError,
    Workload,
    not_json_error,
)

__all__ = [
    "BUNDLED_TRACE",
    "load_bundled",
    "load_mooncake",
    "load_trace",
]


#: The trace shipped in the package (Azure LLM inference trace 2023, conversation; see data/README.md).
BUNDLED_TRACE = "azure_conv_2023.csv.gz"


#: The Mooncake FAST'25 conversation trace shipped in the package, with prefix block ids (data/README.md).
MOONCAKE_TRACE = "mooncake_fast25_conversation.jsonl.gz"


# How many bad-row messages a skipping load keeps for its report.
_KEPT_MESSAGES = 5


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
    if not p.exists():
        raise TraceFileError(f"trace file not found: {path}")
    if not p.is_file():
        raise TraceFileError(f"trace {path} is not a regular file (a device, pipe or socket): give a trace file")
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
            try:
                obj = loads_line(text)
            except json.JSONDecodeError:
                if not rows.rows and line == 1:
                    raise not_json_error(path, text, "mooncake",
                                         "timestamp, input_length, output_length, hash_ids") from None
                raise
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
        except TraceError:
            raise
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
        # The event loop takes requests in arrival order, so a trace out of order is sorted, not refused;
        # say so, since a file whose clock goes backwards may be a merge of two traces.
        latest, back = -math.inf, 0
        for r in self.rows:
            back += r[0] < latest
            latest = max(latest, r[0])
        # Stable: equal arrivals keep file order. A trace already in order (the usual case) is kept as it
        # is, without an index and a copy per row (a large trace's rows are most of what reading it holds).
        order: Sequence[int] = sorted(range(len(self.rows)), key=lambda i: self.rows[i][0]) if back else range(
            len(self.rows))
        rows = [self.rows[i] for i in order] if back else self.rows
        tenants = tuple(self.tenants[i] for i in order) if self.tenants is not None else None
        t0 = rows[0][0]
        notes = []
        if back:
            notes.append(f"sorted by arrival time: {back} of {len(self.rows)} rows arrive earlier than a row "
                         "above them in the file")
        if self.bad:
            notes.append(f"skipped {self.bad} malformed rows; first: {self.messages[0]}")
        if self.excluded:
            notes.append(f"excluded {self.excluded} rows with 0 output tokens (failed in the trace)")
        loras = None
        if self.loras:
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
    twice = duplicated_column(header)
    if twice is not None:
        raise TraceError(f"{path}:1: column {twice!r} appears twice in the header {header}; give each column once")
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
                    raise not_json_error(path, text, "jsonl", "arrival_time, prompt_len, output_len") from None
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
