"""Load test of the OpenAI-compatible server: concurrent streaming clients, short and long prompts.

A bounded number of streaming clients send short prompts in a closed loop (each sends its next request
when the previous one ends) while one more client sends a long prompt every --long-interval seconds, for
--duration seconds. Client-side TTFT, ITL (every gap between consecutive streamed tokens of a request),
E2E and throughput are reported with percentiles, for the short ("running") streams and the long
prompts apart.

The question it answers: while long prompts arrive, does the ITL of the streams already running stay
near the decode step time? With chunked prefill (a token budget smaller than the long prompt) a long
prompt is split over several steps, each no longer than a budget's worth of tokens; without it (a
budget that holds the whole prompt, as when chunking is off) one step carries the whole prompt and
every running stream stalls for it.

Servers (--server):
  fake   a server over tests/server/fake_engine.py whose step sleeps for a roofline step time:
         max(5.3 ms, tokens x 17.8 us), the figures of DESIGN.md section 2 (Llama 3.3 70B, FP8, TP=4
         H100 SXM: a decode-only step is bound by reading 70.55e9 B / 4 / 3.35e12 B/s = 5.3 ms; each
         token costs 2 x 70.55e9 FLOP / (4 x 1,979e12 FLOP/s) = 17.8 us of compute).
  model  `python -m stallfree serve` with the real engine (the bundled model on CPU by default).
  URL    an already running server (http://127.0.0.1:8000); the budget options are then not applied.

Examples:
  python benchmarks/load.py --server fake --compare           # budget 512 vs one that holds the prompt
  python benchmarks/load.py --server model --clients 4 --long-prompt 512 --duration 20 --compare

Imports allowed: the standard library and httpx (the fake server also needs stallfree.server and
uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

# DESIGN.md section 2: Llama 3.3 70B on 4 x H100 SXM, FP8.
DECODE_FLOOR_S = 70.55e9 / 4 / 3.35e12  # weight read per step: 5.3e-3 s
PER_TOKEN_S = 2 * 70.55e9 / (4 * 1979e12)  # compute per token: 1.78e-5 s


@dataclass
class Result:
    """One request as the client saw it. Times in seconds (time.perf_counter)."""

    kind: str  # "short" or "long"
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    ok: bool = False
    status: int = 0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics; nan if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client: httpx.AsyncClient, url: str, model: str | None, prompt: list[int], max_tokens: int,
               kind: str, out: list[Result]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    if model:
        body["model"] = model
    res = Result(kind, time.perf_counter())
    out.append(res)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.ok = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    break
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    res.token_times.append(time.perf_counter())
    except httpx.HTTPError:
        res.status = -1
    finally:
        res.end = time.perf_counter()


async def run_load(url: str, args: argparse.Namespace, model: str | None) -> list[Result]:
    """Drive the server for args.duration seconds; return every request started."""
    rng = random.Random(args.seed)
    results: list[Result] = []
    stop_at = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.clients + 8)
    timeout = httpx.Timeout(args.duration + 120.0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def short_client() -> None:
            while time.perf_counter() < stop_at:
                await _one(client, url, model, ids(args.short_prompt), args.max_tokens, "short", results)

        async def long_client() -> None:
            tasks = []
            await asyncio.sleep(min(args.long_interval / 2, args.duration / 4))  # let the streams start
            while time.perf_counter() < stop_at:
                tasks.append(asyncio.create_task(
                    _one(client, url, model, ids(args.long_prompt), args.long_max_tokens, "long", results)))
                await asyncio.sleep(args.long_interval)
            await asyncio.gather(*tasks)

        await asyncio.gather(long_client(), *(short_client() for _ in range(args.clients)))
    return results


def summarize(results: list[Result], wall_s: float) -> dict[str, float]:
    """vLLM benchmark-style figures (ms; requests/s; tokens/s) for the short and long requests."""
    out: dict[str, float] = {}
    done = [r for r in results if r.ok and r.token_times]
    out["completed"] = len(done)
    out["failed"] = len(results) - len(done)
    out["request_throughput"] = len(done) / wall_s
    out["output_throughput"] = sum(len(r.token_times) for r in done) / wall_s
    for kind in ("short", "long"):
        rs = [r for r in done if r.kind == kind]
        ttft = [(r.token_times[0] - r.start) * 1e3 for r in rs]
        itl = [(b - a) * 1e3 for r in rs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
        e2e = [(r.end - r.start) * 1e3 for r in rs]
        out[f"{kind}_completed"] = len(rs)
        for name, xs in (("ttft", ttft), ("itl", itl), ("e2el", e2e)):
            out[f"{kind}_mean_{name}_ms"] = sum(xs) / len(xs) if xs else math.nan
            for q in (50, 90, 99, 99.9):
                label = "median" if q == 50 else f"p{q:g}"
                out[f"{kind}_{label}_{name}_ms"] = percentile(xs, q)
            out[f"{kind}_max_{name}_ms"] = max(xs) if xs else math.nan
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(cmd: list[str], env: dict[str, str], port: int, startup_s: float, log_prefix: str = "stallfree-server-",
           stop_s: float = 60.0):
    """Run a server command listening on 127.0.0.1:`port`; yield (URL, process) once GET /health answers 200;
    stop it after (SIGTERM, then SIGKILL past `stop_s` seconds). Its output goes to a temporary log file, not
    a pipe nobody reads (a full pipe would block its logging), named by `process.log_path`.

    Raises:
        RuntimeError: the server exited before it was healthy (with its log's tail), or was not healthy
            within `startup_s` seconds.
    """
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_s:g} s")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def launched(kind: str, budget: int, args: argparse.Namespace):
    """Start a server subprocess on a free loopback port; yield its URL; stop it after."""
    with launched_process(kind, budget, args) as (url, _proc):
        yield url


@contextlib.contextmanager
def launched_process(kind: str, budget: int, args: argparse.Namespace, extra: tuple[str, ...] = ()):
    """Start a server subprocess on a free loopback port with `extra` options; yield (URL, process)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    if kind == "fake":
        cmd = [sys.executable, __file__, "_fake_server", "--port", str(port), "--token-budget", str(budget),
               "--max-seqs", str(args.max_seqs), *extra]
    else:
        cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--token-budget", str(budget),
               "--max-seqs", str(args.max_seqs), "--log-interval", "0"]
        if args.model:
            cmd += ["--model", args.model]
        if args.kv_tokens:
            cmd += ["--kv-tokens", str(args.kv_tokens)]
        cmd += list(extra)
    env.update(getattr(args, "server_env", None) or {})
    with served(cmd, env, port, args.startup_timeout) as running:
        yield running


def fake_server_main(argv: list[str]) -> int:
    """Serve FakeEngine with a roofline step time on 127.0.0.1 (the `_fake_server` subcommand)."""
    p = argparse.ArgumentParser(prog="load.py _fake_server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-budget", type=int, required=True)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1_000_000)
    from stallfree.server.options import add_ops_args, ops_from_args

    add_ops_args(p)  # --api-key (or STALLFREE_API_KEY), --shutdown-timeout, ... as `stallfree serve`
    a = p.parse_args(argv)
    ops, problem = ops_from_args(a)
    if ops is None:
        p.error(str(problem))

    from server.fake_engine import FakeEngine, FakeSamplingParams
    from stallfree.server import ServerConfig, create_app
    from stallfree.server.ops import install_ops, run_server

    def step_time(plan) -> float:
        return max(DECODE_FLOOR_S, plan.num_tokens * PER_TOKEN_S)

    eng = FakeEngine(token_budget=a.token_budget, max_seqs=a.max_seqs, kv_tokens=10_000_000,
                     max_model_len=a.max_model_len, step_time_s=step_time)
    app = create_app(eng, ServerConfig(sampling_params_cls=FakeSamplingParams, log_interval_s=0,
                                       max_waiting=a.max_waiting))
    drain = install_ops(app, ops)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("stallfree.server.access").setLevel(logging.WARNING)  # no line per request here
    rc = run_server(app, "127.0.0.1", a.port, ops, log_level="warning")
    # What a drain left: every KV token free, no request held (the soak's SIGTERM phase reads this).
    print(json.dumps({"kv_free": eng.scheduler.kv_free, "kv_total": eng.scheduler.stats().kv_total,
                      "unfinished": eng.has_unfinished(), "added": len(eng.added),
                      "refused_to_the_end": drain.num_refused, "drain": drain.summary}),
          flush=True)
    return rc


def _print(label: str, s: dict[str, float]) -> None:
    print(f"\n== {label}: {s['completed']:.0f} requests ({s['failed']:.0f} failed), "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tokens/s")
    heads = ("mean", "p50", "p90", "p99", "p99.9", "max")
    print(f"{'':8s} {'metric':5s} " + " ".join(f"{h:>9s}" for h in heads) + "  (ms)")
    for kind in ("short", "long"):
        for name in ("ttft", "itl", "e2el"):
            vals = [s[f"{kind}_{k}_{name}_ms"] for k in ("mean", "median", "p90", "p99", "p99.9", "max")]
            print(f"{kind:8s} {name:5s} " + " ".join(f"{v:9.1f}" for v in vals))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table(s); optionally write JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_fake_server":
        return fake_server_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="fake", help="fake | model | an http://127.0.0.1:PORT URL")
    p.add_argument("--model", default=None, help="model path for --server model (default: bundled)")
    p.add_argument("--served-model", default=None, help="model name to send (default: none)")
    p.add_argument("--clients", type=int, default=16, help="concurrent short-prompt streams (default 16)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load (default 15)")
    p.add_argument("--short-prompt", type=int, default=32, help="short prompt length, tokens (default 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per short request (default 128)")
    p.add_argument("--long-prompt", type=int, default=8192, help="long prompt length, tokens (default 8192)")
    p.add_argument("--long-max-tokens", type=int, default=8, help="tokens per long request (default 8)")
    p.add_argument("--long-interval", type=float, default=0.5,
                   help="seconds between long prompts (default 0.5)")
    p.add_argument("--token-budget", type=int, default=512, help="budget with chunked prefill (default 512)")
    p.add_argument("--compare", action="store_true",
                   help="also run with a budget that holds the whole long prompt (no chunking)")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    if args.clients < 1 or args.clients > 256 or not 0 < args.duration <= 600:
        p.error("--clients must be in 1..256 and --duration in (0, 600] seconds")

    runs: dict[str, dict[str, float]] = {}
    configs = [("chunked", args.token_budget)]
    if args.compare:
        configs.append(("unchunked", args.long_prompt + args.clients + 1))
    for label, budget in configs:
        if args.server in ("fake", "model"):
            with launched(args.server, budget, args) as url:
                t0 = time.perf_counter()
                res = asyncio.run(run_load(url, args, args.served_model))
                wall = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            res = asyncio.run(run_load(args.server.rstrip("/"), args, args.served_model))
            wall = time.perf_counter() - t0
        s = summarize(res, wall)
        s["token_budget"] = budget
        runs[f"{label} (budget {budget})"] = s
        _print(f"{label}, token budget {budget}", s)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
