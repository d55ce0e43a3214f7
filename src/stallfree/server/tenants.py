"""Tenants of the server: which client an API key belongs to, its weight, and bounded metric labels.

`serve --api-keys-file FILE` reads a CSV with the header `key,tenant,weight`: one row per key, the tenant
it belongs to (several keys may share a tenant) and the tenant's weight under `--fairness vtc` (a finite
number > 0; every row of a tenant gives the same one). `--api-key KEY` alone is one key of the tenant
"default". The API-key middleware (stallfree.server.auth) puts the tenant of the key a request carries
in the request's ASGI scope (TENANT_SCOPE_KEY); the route passes it to the engine as Request.tenant, the
access log line names it, and the metrics count tokens per tenant under a bounded set of labels.

Imports allowed: the standard library, stallfree.core, stallfree.server.options and .request_id.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stallfree.core.request import DEFAULT_TENANT, MAX_TENANT_CHARS
from stallfree.server.options import ServerConfigError, check_api_key
from stallfree.server.request_id import TENANT_SCOPE_KEY

__all__ = ["MAX_TENANT_LABELS", "OTHER_TENANT", "TENANT_SCOPE_KEY", "TenantKeys", "TokenRateLimiter",
           "load_api_keys_file", "tenant_label"]

#: The most tenant label values the metrics use; tenants past them are counted under OTHER_TENANT.
MAX_TENANT_LABELS = 64
#: The label of the tenants past MAX_TENANT_LABELS.
OTHER_TENANT = "other"
_HEADER = ["key", "tenant", "weight"]
_MAX_FILE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TenantKeys:
    """The API keys and their tenants.

    Attributes:
        keys: key -> tenant name.
        weights: tenant name -> weight (> 0), for SchedulerConfig.tenant_weights.
    """

    keys: Mapping[str, str]
    weights: Mapping[str, float]

    def __repr__(self) -> str:
        # The keys never reach a log line or a traceback through this object.
        return f"TenantKeys({len(self.keys)} keys, tenants {sorted(self.weights)})"


def load_api_keys_file(path: str | Path) -> TenantKeys:
    """Read `--api-keys-file`: a CSV with the header `key,tenant,weight` and one key per row.

    Args:
        path: the file (UTF-8).

    Returns:
        The keys and the tenants' weights.

    Raises:
        ServerConfigError: the file cannot be read or is over 16 MiB; the header is not exactly
            `key,tenant,weight`; a row is malformed (not three fields, a key that cannot be sent in a header,
            a tenant empty or over 128 characters, a weight that is not a finite number > 0); a key is given
            twice; a tenant's rows give different weights; or there is no key. The message names the file
            and the line, never a key.
    """
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_FILE_BYTES:
            raise ServerConfigError(f"--api-keys-file {path}: larger than 16 MiB")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ServerConfigError(f"--api-keys-file {path}: cannot read it ({exc})") from None
    rows = csv.reader(text.splitlines())
    header = [h.strip() for h in next(rows, [])]
    if header != _HEADER:
        raise ServerConfigError(f"--api-keys-file {path}:1: the header must be key,tenant,weight, got "
                                f"{','.join(header)[:80]!r}")
    keys: dict[str, str] = {}
    weights: dict[str, float] = {}
    for line, row in enumerate(rows, start=2):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        where = f"--api-keys-file {path}:{line}"
        if len(row) != 3:
            raise ServerConfigError(f"{where}: expected 3 fields (key,tenant,weight), got {len(row)}")
        key, tenant, weight_text = (f.strip() for f in row)
        problem = check_api_key(key, f"{where}: the key")
        if problem is not None:
            raise ServerConfigError(problem)
        if key in keys:
            raise ServerConfigError(f"{where}: this key is given twice (each key belongs to one tenant)")
        if not tenant or len(tenant) > MAX_TENANT_CHARS:
            raise ServerConfigError(f"{where}: tenant must be 1 to {MAX_TENANT_CHARS} characters, got {tenant[:40]!r}")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or weight <= 0:
            raise ServerConfigError(f"{where}: weight must be a finite number > 0, got {weight_text[:40]!r}")
        if weights.get(tenant, weight) != weight:
            raise ServerConfigError(f"{where}: tenant {tenant!r} has weight {weights[tenant]:g} on an earlier row, "
                                    f"{weight:g} here; give one weight per tenant")
        keys[key] = tenant
        weights[tenant] = weight
    if not keys:
        raise ServerConfigError(f"--api-keys-file {path}: no key; give at least one row after the header")
    return TenantKeys(keys, weights)


def single_key(api_key: str) -> TenantKeys:
    """`--api-key` alone: one key of the tenant "default" (weight 1)."""
    return TenantKeys({api_key: DEFAULT_TENANT}, {DEFAULT_TENANT: 1.0})


def tenant_label(tenant: str, known: set[str]) -> str:
    """The metric label of `tenant`: itself while fewer than MAX_TENANT_LABELS labels are in use (it joins
    `known`), else OTHER_TENANT, so that a server never grows an unbounded number of label values."""
    if tenant in known:
        return tenant
    if len(known) < MAX_TENANT_LABELS:
        known.add(tenant)
        return tenant
    return OTHER_TENANT


class TokenRateLimiter:
    """Per-tenant token rate limits (serve --tenant-tokens-per-minute): a token bucket per tenant.

    Each tenant's bucket holds at most `tokens_per_minute` tokens and refills at tokens_per_minute / 60
    tokens a second; a request takes its prompt tokens plus its max_tokens (what it may cost), at most a
    full bucket, so that a request larger than a minute's allowance still passes on a full bucket.

    Args:
        tokens_per_minute: the allowance, tokens, an integer >= 1.
        clock: seconds (time.monotonic).

    Raises:
        ServerConfigError: tokens_per_minute is not an integer >= 1.

    Source: the token bucket (Turner, 1986), as API gateways meter tokens per minute.
    """

    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(tokens_per_minute, bool) or not isinstance(tokens_per_minute, int) or tokens_per_minute < 1:
            raise ServerConfigError(f"tenant_tokens_per_minute must be an integer >= 1, got {tokens_per_minute!r}")
        self.capacity = float(tokens_per_minute)
        self.rate_per_s = tokens_per_minute / 60.0
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when)

    def take(self, tenant: str, tokens: int) -> float | None:
        """Take `tokens` from the tenant's bucket: None when it had them, else the seconds until it will
        (nothing is taken then)."""
        now = self.clock()
        level, then = self._buckets.get(tenant, (self.capacity, now))
        level = min(self.capacity, level + (now - then) * self.rate_per_s)
        need = min(float(tokens), self.capacity)
        if level >= need:
            self._buckets[tenant] = (level - need, now)
            return None
        self._buckets[tenant] = (level, now)
        return (need - level) / self.rate_per_s
