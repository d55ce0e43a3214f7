"""GPU prices and availability for `stallfree plan`: US dollars per GPU-hour from the user's flags or
file, and the most GPUs of a type to buy. No price is built in: a price changes by provider, region,
commitment and month, so it is the user's figure, with its source and date where the file gives them.

Imports allowed: the standard library, stallfree._files, stallfree.core and stallfree.costmodel.

Formats:
    --gpu-price NAME=USD,...     e.g. h100-sxm=2.99,h200=3.79 (US dollars per GPU-hour)
    --prices FILE                CSV with a header `gpu,usd_per_hour[,source,date]`, or JSON
                                 {"h100-sxm": 2.99, ...} (or {"h100-sxm": {"usd_per_hour": 2.99,
                                 "source": "...", "date": "..."}})
    --max-gpus NAME=N,...        the most GPUs of each type a fleet may use
GPU names are our presets' (stallfree.costmodel.hardware.list_gpus; '-' and '_' alike).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree._files import duplicated_column, open_text, read_json
from stallfree.core.errors import StallfreeError
from stallfree.costmodel import CostModelError
from stallfree.costmodel.hardware import get_gpu

__all__ = ["GpuPrice", "PriceError", "gpu_key", "load_prices", "parse_gpu_prices", "parse_max_gpus"]


class PriceError(StallfreeError, ValueError):
    """A price or a GPU cap that cannot be read: an unknown GPU, a price that is negative or not finite,
    a file without the `gpu` or `usd_per_hour` column; the message names the value (commands exit 2)."""


@dataclass(frozen=True, slots=True)
class GpuPrice:
    """One GPU type's price.

    Attributes:
        gpu: our preset's name (stallfree.costmodel.hardware).
        usd_per_hour: US dollars per GPU-hour, >= 0 and finite.
        source: where the figure comes from (a file's `source` column), or None.
        date: when it was read there (a file's `date` column), or None.
    """

    gpu: str
    usd_per_hour: float
    source: str | None = None
    date: str | None = None


def gpu_key(name: str) -> str:
    """Our preset name of GPU `name` ('-' and '_' alike, aliases allowed).

    Raises:
        PriceError: the name is not a known GPU (the message lists the known ones).
    """
    if str(name).endswith(".json"):
        raise PriceError(f"GPU {name!r}: give a preset name, not a spec file, for a price or a cap")
    try:
        return get_gpu(name.strip()).key
    except CostModelError as exc:
        raise PriceError(str(exc)) from None


def _usd(text: Any, where: str) -> float:
    """A price in US dollars per GPU-hour, >= 0 and finite.

    Raises:
        PriceError: not a number, negative or not finite, naming `where` and the value.
    """
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise PriceError(f"{where}: the price {text!r} is not a number of US dollars per GPU-hour") from None
    if not math.isfinite(value) or value < 0:
        raise PriceError(f"{where}: the price {text!r} must be a finite number >= 0 of US dollars per GPU-hour")
    return value


def _pairs(text: str, flag: str) -> list[tuple[str, str]]:
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise PriceError(f"{flag} {text!r}: each item is NAME=VALUE, got {item!r}")
        out.append((name.strip(), value.strip()))
    if not out:
        raise PriceError(f"{flag} {text!r}: give at least one NAME=VALUE")
    return out


def parse_gpu_prices(text: str, flag: str = "--gpu-price") -> dict[str, GpuPrice]:
    """Prices of "NAME=USD,..." by preset name.

    Raises:
        PriceError: a malformed item, an unknown GPU, a bad price, or a GPU given twice.
    """
    out: dict[str, GpuPrice] = {}
    for name, value in _pairs(text, flag):
        key = gpu_key(name)
        if key in out:
            raise PriceError(f"{flag}: {key} is priced twice")
        out[key] = GpuPrice(key, _usd(value, f"{flag} {name}"), f"{flag}", None)
    return out


def parse_max_gpus(text: str, flag: str = "--max-gpus") -> dict[str, int]:
    """The most GPUs of each type, "NAME=N,..." by preset name.

    Raises:
        PriceError: a malformed item, an unknown GPU, or N not an integer >= 1.
    """
    out: dict[str, int] = {}
    for name, value in _pairs(text, flag):
        key = gpu_key(name)
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise PriceError(f"{flag} {name}={value}: the cap must be an integer >= 1 GPUs")
        out[key] = n
    return out


def load_prices(path: str | Path) -> dict[str, GpuPrice]:
    """Prices from a file: JSON (a .json name or a document starting with '{') or CSV with a header
    `gpu,usd_per_hour[,source,date]` (module docstring).

    Raises:
        PriceError: an unreadable file, a missing column, an unknown GPU, a bad price, a GPU twice.
    """
    p = Path(path)
    flag = f"--prices {p}"
    try:
        with open_text(p) as fh:
            text = fh.read(1 << 20)  # a price list is a few lines; 1 MiB is far past any
    except (OSError, ValueError) as exc:
        raise PriceError(f"{flag}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        return _json_prices(p, flag)
    rows = list(csv.DictReader(io.StringIO(text)))
    header = [h.strip() for h in (csv.DictReader(io.StringIO(text)).fieldnames or [])]
    twice = duplicated_column(header)
    if twice is not None:
        raise PriceError(f"{flag}: column {twice!r} appears twice in the CSV header; give each column once")
    for column in ("gpu", "usd_per_hour"):
        if column not in header:
            raise PriceError(f"{flag}: the CSV has no {column!r} column (header: {','.join(header) or 'none'}); "
                             "it needs gpu,usd_per_hour[,source,date]")
    out: dict[str, GpuPrice] = {}
    for line, row in enumerate(rows, start=2):
        row = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
        key = gpu_key(row["gpu"]) if row.get("gpu") else None
        if key is None:
            raise PriceError(f"{flag} line {line}: no gpu")
        if key in out:
            raise PriceError(f"{flag} line {line}: {key} is priced twice")
        out[key] = GpuPrice(key, _usd(row.get("usd_per_hour"), f"{flag} line {line}"),
                            row.get("source") or None, row.get("date") or None)
    if not out:
        raise PriceError(f"{flag}: no price in it")
    return out


def _json_prices(p: Path, flag: str) -> dict[str, GpuPrice]:
    try:
        data = read_json(p)
    except (OSError, ValueError) as exc:
        raise PriceError(f"{flag}: not a JSON document ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise PriceError(f'{flag}: want an object of prices, {{"h100-sxm": 2.99}}')
    out: dict[str, GpuPrice] = {}
    for name, value in data.items():
        key = gpu_key(str(name))
        if key in out:
            raise PriceError(f"{flag}: {key} is priced twice")
        if isinstance(value, dict):
            if "usd_per_hour" not in value:
                raise PriceError(f"{flag} {name}: no 'usd_per_hour'")
            out[key] = GpuPrice(key, _usd(value["usd_per_hour"], f"{flag} {name}"),
                                value.get("source"), value.get("date"))
        else:
            out[key] = GpuPrice(key, _usd(value, f"{flag} {name}"))
    return out
