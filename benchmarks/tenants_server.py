"""The adversary's case on the real server: one key floods long prompts while another sends short ones.

A `stallfree serve` subprocess (the bundled SmolLM2-135M on CPU unless --model; --kv-policy paged, its
default) gets a keys file with two tenants, "flood" and "light". For --duration seconds:

- the flood key keeps --flood-concurrency requests of --flood-prompt tokens (max_tokens 4) in flight;
- the light key keeps one stream running (--stream-tokens tokens, started first: its worst gap between two
  tokens is the stall a running user sees), and sends a short request (--short-prompt tokens, max_tokens 2)
  every --short-interval seconds, whose TTFT is measured.

The same load runs with `--fairness fcfs` and `--fairness vtc`. Reported per run: the light tenant's short
requests (count, TTFT p50/p99, s), the running stream's worst token gap (s), and the flood's completed
requests. Streams use `ignore_eos` and temperature 0.

Usage:
    PYTHONPATH=src python benchmarks/tenants_server.py --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, served  # noqa: E402  (the server start and stop every serving benchmark shares)

KEYS = "key,tenant,weight\nsk-flood,flood,1\nsk-light,light,1\n"


@contextlib.contextmanager
def server(fairness: str, args: argparse.Namespace, keys: Path):
    """A serve subprocess with the keys file and `fairness`; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--api-keys-file", str(keys),
           "--fairness", fairness, "--max-num-batched-tokens", str(args.token_budget), "--log-interval", "0"]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with served(cmd, env, port, 180.0, log_prefix="stallfree-tenants-") as (url, _proc):
        yield url


async def _stream(client: httpx.AsyncClient, url: str, key: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion; its start, token times and status."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0}
    out: dict[str, Any] = {"start": time.perf_counter(), "tokens": [], "status": None}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    out["tokens"].append(time.perf_counter())
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Drive the server for args.duration seconds; the figures of one run."""
    rng = random.Random(args.seed)
    stop_at = time.perf_counter() + args.duration

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.duration + 600.0),
                                 limits=httpx.Limits(max_connections=64)) as client:
        running = asyncio.create_task(_stream(client, url, "sk-light", ids(8), args.stream_tokens))
        await asyncio.sleep(1.0)  # the stream is decoding before the flood starts
        flood_done: list[dict[str, Any]] = []
        shorts: list[dict[str, Any]] = []

        async def flooder() -> None:
            while time.perf_counter() < stop_at:
                flood_done.append(await _stream(client, url, "sk-flood", ids(args.flood_prompt), 4))

        async def light() -> None:
            tasks = []
            await asyncio.sleep(args.short_interval)
            while time.perf_counter() < stop_at:
                tasks.append(asyncio.create_task(_stream(client, url, "sk-light", ids(args.short_prompt), 2)))
                await asyncio.sleep(args.short_interval)
            shorts.extend(await asyncio.gather(*tasks))

        await asyncio.gather(light(), *(flooder() for _ in range(args.flood_concurrency)))
        stream = await running
    ttft = [s["tokens"][0] - s["start"] for s in shorts if s["status"] == 200 and s["tokens"]]
    gaps = [b - a for a, b in zip(stream["tokens"], stream["tokens"][1:], strict=False)]
    return {"light_short_requests": len(ttft), "light_ttft_p50_s": _pct(ttft, 50), "light_ttft_p99_s": _pct(ttft, 99),
            "light_ttft_max_s": max(ttft) if ttft else None,
            "running_stream_worst_gap_s": max(gaps) if gaps else None, "running_stream_tokens": len(stream["tokens"]),
            "flood_completed": sum(1 for f in flood_done if f["status"] == 200)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    ap.add_argument("--flood-prompt", type=int, default=2000, help="flood prompt, tokens")
    ap.add_argument("--flood-concurrency", type=int, default=2, help="flood requests in flight")
    ap.add_argument("--short-prompt", type=int, default=8, help="light request prompt, tokens")
    ap.add_argument("--short-interval", type=float, default=3.0, help="seconds between light requests")
    ap.add_argument("--stream-tokens", type=int, default=120, help="the light running stream's max_tokens")
    ap.add_argument("--token-budget", type=int, default=512, help="--max-num-batched-tokens (default 512)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fairness", nargs="+", default=["fcfs", "vtc"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        keys = Path(d) / "keys.csv"
        keys.write_text(KEYS)
        out = {}
        for fairness in args.fairness:
            with server(fairness, args, keys) as url:
                out[fairness] = asyncio.run(load(url, args))
            print(fairness, json.dumps(out[fairness]), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
