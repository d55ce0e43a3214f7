"""The operator's options of `stallfree serve` (API key, shutdown deadline, read and keep-alive timeouts,
connection limit) as flags and as OpsConfig, checked without importing any HTTP library, so that a bad
value is refused before the model loads.

Sources: vLLM's `--api-key` and VLLM_API_KEY (here STALLFREE_API_KEY); uvicorn's `--limit-concurrency`
and `--timeout-keep-alive` (default 5 s, as vLLM's); Kubernetes' 30 s termination grace period (the
default --shutdown-timeout); nginx's client_header_timeout / client_body_timeout for the read timeout.

Imports allowed: the standard library, stallfree._argtypes and stallfree.core.errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from stallfree._argtypes import non_negative_float, positive_float, positive_int
from stallfree.core.errors import StallfreeError

__all__ = ["API_KEY_ENV", "OpsConfig", "ServerConfigError", "add_ops_args", "check_api_key", "configure_logging",
           "isolate_metrics", "ops_banner", "ops_from_args", "resolve_api_key"]

#: The environment variable read when --api-key is not given (it keeps the key out of `ps`).
API_KEY_ENV = "STALLFREE_API_KEY"


class ServerConfigError(StallfreeError, ValueError):
    """An operator's option of the server is out of range; the message names it and its value (never a key)."""


def check_api_key(key: str, source: str) -> str | None:
    """Check that a key can be sent in an HTTP header: 1 to 4096 visible ASCII characters, no spaces.

    Args:
        key: the key.
        source: where it came from ("--api-key" or the environment variable's name), for the message.

    Returns:
        None when it is fine, else a message naming the source and what is wrong, never the key itself.
    """
    if not key:
        return f"{source} is empty; give a key, or leave it out to serve without one"
    if len(key) > 4096:
        return f"{source} is {len(key)} characters long; at most 4096 fit in a header"
    if not all("!" <= c <= "~" for c in key):
        return (f"{source} must be visible ASCII characters without spaces (the key given has "
                f"{len(key)} characters, some outside that range)")
    return None


def resolve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The API key to require: --api-key when given, else STALLFREE_API_KEY when set and not empty.

    Args:
        flag: the value of --api-key (None when not given).
        environ: the environment (os.environ by default).

    Returns:
        (key or None, its source: "--api-key", "STALLFREE_API_KEY" or "none").

    Raises:
        ServerConfigError (a ValueError): the key cannot be sent in a header (check_api_key's message,
            which never holds the key).
    """
    env = os.environ if environ is None else environ
    if flag is not None:
        key, source = flag, "--api-key"
    elif env.get(API_KEY_ENV):
        key, source = env[API_KEY_ENV], API_KEY_ENV
    else:
        return None, "none"
    problem = check_api_key(key, source)
    if problem is not None:
        raise ServerConfigError(problem)
    return key, source


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """The operator's options of a server.

    Args:
        api_key: the key every /v1 route requires as `Authorization: Bearer KEY`; None: no key.
        protect_metrics: /metrics requires the key too (only with api_key).
        shutdown_timeout_s: seconds the requests in flight may take to finish after SIGTERM/SIGINT
            before the rest are aborted (>= 0; 30, Kubernetes' default grace period).
        request_read_timeout_s: seconds a request's headers may take to arrive, and then its body
            (> 0; 30).
        timeout_keep_alive_s: seconds an idle keep-alive connection is kept (> 0; 5, as vLLM).
        limit_concurrency: the most connections (and tasks) before uvicorn answers 503; None: no limit.
        log_access: one access line per request (logger stallfree.server.access), with its id.
        api_keys: more keys, key -> tenant (serve --api-keys-file), or None; every /v1 route then needs
            one of them (or api_key, the tenant "default").
        tenant_weights: tenant -> weight from the keys file (for --fairness vtc), or None.

    Raises:
        ServerConfigError (a ValueError): an option out of range, naming it and its value (never the key itself).
    """

    api_key: str | None = None
    protect_metrics: bool = False
    shutdown_timeout_s: float = 30.0
    request_read_timeout_s: float = 30.0
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int | None = None
    log_access: bool = True
    api_keys: Mapping[str, str] | None = None
    tenant_weights: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None:
            problem = check_api_key(self.api_key, "api_key")
            if problem is not None:
                raise ServerConfigError(problem)
        if self.protect_metrics and self.api_key is None and not self.api_keys:
            raise ServerConfigError("protect_metrics=True needs an api_key (--protect-metrics needs --api-key or "
                             "STALLFREE_API_KEY)")
        for name, low, strict in (("shutdown_timeout_s", 0, False), ("request_read_timeout_s", 0, True),
                                  ("timeout_keep_alive_s", 0, True)):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and (
                value > low if strict else value >= low)
            if not ok:
                raise ServerConfigError(f"{name} must be a number of seconds {'>' if strict else '>='} {low}, "
                                 f"got {value!r}")
        c = self.limit_concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ServerConfigError(f"limit_concurrency must be an integer >= 1 or None, got {c!r}")

    def __repr__(self) -> str:
        # The key never reaches a log line or a traceback through this object.
        key = None if self.api_key is None and not self.api_keys else "<set>"
        return (f"OpsConfig(api_key={key}, protect_metrics={self.protect_metrics}, "
                f"shutdown_timeout_s={self.shutdown_timeout_s}, request_read_timeout_s="
                f"{self.request_read_timeout_s}, timeout_keep_alive_s={self.timeout_keep_alive_s}, "
                f"limit_concurrency={self.limit_concurrency}, log_access={self.log_access})")


def add_ops_args(p: argparse.ArgumentParser) -> None:
    """Add --api-key, --protect-metrics, --shutdown-timeout, --request-read-timeout, --timeout-keep-alive
    and --limit-concurrency to `serve`."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on every /v1 route (default: the environment "
                   f"variable {API_KEY_ENV}, which keeps the key out of process listings; none when unset); "
                   "/health stays open")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="API keys of several tenants: a CSV with the header key,tenant,weight (weight: the "
                   "tenant's share under --fairness vtc, > 0); every /v1 route needs one of the keys, and the "
                   "request is served for its tenant (docs/server.md, Tenants)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="require the API key for /metrics too (default: /metrics is open)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM or SIGINT, seconds the requests in flight may take to finish while new "
                   "ones get 503, before the rest are aborted (default 30)")
    p.add_argument("--request-read-timeout", type=positive_float, default=30.0, metavar="S",
                   help="seconds a request's headers may take to arrive, and then its body; a slower client "
                   "gets 408 and is disconnected (default 30)")
    p.add_argument("--timeout-keep-alive", type=positive_float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection is kept open (default 5)")
    p.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                   help="the most open connections; past it requests get 503 (default: no limit)")


def ops_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None,
    api_keys: Mapping[str, str] | None = None, tenant_weights: Mapping[str, float] | None = None,
) -> tuple[OpsConfig | None, str | None]:
    """The OpsConfig of parsed `serve` options, or (None, a message naming the option) when one is wrong.

    Args:
        args: the parsed options.
        environ: the environment (os.environ by default).
        api_keys, tenant_weights: the keys file's keys (key -> tenant) and weights, already read
            (stallfree.server.tenants.load_api_keys_file), or None.

    The message never holds the key.
    """
    try:
        key, _ = resolve_api_key(args.api_key, environ)
    except ValueError as exc:
        return None, str(exc)
    if api_keys is not None:
        if args.api_key is not None:
            return None, ("--api-key and --api-keys-file: give one (a key of the tenant default can be a row of "
                          "the file)")
        key = None  # the file's keys replace the environment's single key
    if args.protect_metrics and key is None and api_keys is None:
        return None, f"--protect-metrics needs --api-key or {API_KEY_ENV}"
    try:
        return OpsConfig(api_key=key, protect_metrics=args.protect_metrics,
                         shutdown_timeout_s=args.shutdown_timeout, request_read_timeout_s=args.request_read_timeout,
                         timeout_keep_alive_s=args.timeout_keep_alive,
                         limit_concurrency=args.limit_concurrency,
                         api_keys=None if api_keys is None else dict(api_keys),
                         tenant_weights=None if tenant_weights is None else dict(tenant_weights)), None
    except ValueError as exc:
        return None, str(exc)


def isolate_metrics(ops: OpsConfig, prefix_cache_isolation: str) -> tuple[OpsConfig | None, str | None]:
    """Under prefix-cache isolation "salt", /metrics needs the key: its per-request prompt lengths and
    cached shares would tell one tenant about the others' prompts.

    Args:
        ops: the operator's options.
        prefix_cache_isolation: "none" or "salt" (serve --prefix-cache-isolation).

    Returns:
        (ops, None) unchanged under "none"; (ops with protect_metrics, None) under "salt" with a key;
        (None, a message naming the options) under "salt" without a key.
    """
    if prefix_cache_isolation != "salt":
        return ops, None
    if ops.api_key is None and not ops.api_keys:
        return None, (f"--prefix-cache-isolation salt needs --api-key or {API_KEY_ENV}: it keeps tenants apart, "
                      "and /metrics (which shows per-request prompt lengths and cached shares) must then need "
                      "the key")
    return dataclasses.replace(ops, protect_metrics=True), None


def ops_banner(ops: OpsConfig) -> str:
    """The banner's line about the operator's options (whether a key is required, never the key)."""
    if ops.api_keys:
        key = f"API keys of {len(set(ops.api_keys.values()))} tenant(s) required on /v1" + (
            " and /metrics" if ops.protect_metrics else "")
    elif ops.api_key is None:
        key = "no API key (anyone who can reach the port can use it)"
    else:
        key = "API key required on /v1" + (" and /metrics" if ops.protect_metrics else "")
    limit = "none" if ops.limit_concurrency is None else f"{ops.limit_concurrency:,}"
    return (f"  {key} | --shutdown-timeout {ops.shutdown_timeout_s:g} s | --request-read-timeout "
            f"{ops.request_read_timeout_s:g} s | --timeout-keep-alive {ops.timeout_keep_alive_s:g} s | "
            f"--limit-concurrency {limit}")


def configure_logging() -> None:
    """Log at INFO to stderr, each line with the id of the request it was made for ("-" for none)."""
    from stallfree.server.request_id import RequestIdFilter

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
