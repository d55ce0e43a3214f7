"""Soak test of LoRA adapters on the server: traffic over three adapters and the base model while a fourth
adapter is loaded and unloaded again and again; then the server must be idle and whole again.

It writes three seeded random PEFT adapters (a1, a2, a3; stallfree.engine.lora.random_peft_adapter) and a
fourth ("hot") for the bundled model into a temporary folder, starts `stallfree serve --enable-lora
--lora-modules a1=... a2=... a3=... --max-loras 2` (the real engine on the CPU), and for --duration seconds:
  * --clients clients send requests in a closed loop, each naming base, a1, a2, a3 or hot at random (half of
    them streamed); a request for hot while it is unloaded must be a 404, every other one a 200;
  * one client, every --churn-interval seconds, loads hot (POST /v1/load_lora_adapter) and unloads it again
    a moment later, and also tries a load that must fail: a folder without its files, a rank above
    --max-lora-rank, a name already served (each a 400);
  * the server's resident memory is sampled every --rss-interval seconds.
Then it waits for the server to go idle and reads /metrics.

It reports responses by status (5xx must be 0), the loads and unloads done, the gauges at the end
(running, waiting, every stallfree_lora_requests_active; all must be 0), the requests and device loads per
adapter, and the server's memory: at the first sample, at the end, at each tenth of the run, and the largest
and smallest over the second half (flat: the churn leaves no weights behind). --no-churn runs the same
traffic without loads and unloads, the baseline for the memory figures.

Example:
  python benchmarks/lora_soak.py --duration 120 --clients 6

Imports allowed: the standard library, httpx, torch and stallfree (to write the adapters), and
benchmarks/load.py (its server launcher).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import launched_process  # noqa: E402

ADAPTERS = ("a1", "a2", "a3")
MODULES = (["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["q_proj", "k_proj"])
PROMPTS = ("The capital of France is", "def fib(n):", "Write a haiku about the sea.", "1, 2, 3, 4,")


def write_adapters(root: Path, model: str | None) -> dict[str, Path]:
    """Write a1, a2, a3, hot (rank 8) and two bad folders ("empty": no files; "rank64": r 64) under `root`."""
    from stallfree.engine.lora import random_peft_adapter
    from stallfree.engine.weights import load_checkpoint

    cfg = load_checkpoint(model).config
    out = {}
    for i, name in enumerate((*ADAPTERS, "hot")):
        random_peft_adapter(root / name, cfg, MODULES[i], 8, 16, seed=100 + i, b_std=0.1)
        out[name] = root / name
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    random_peft_adapter(root / "rank64", cfg, ["q_proj"], 64, 64, seed=200)
    out["rank64"] = root / "rank64"
    return out


class Tally:
    """Responses by (what, status); hot's 404s are expected while it is unloaded."""

    def __init__(self) -> None:
        self.by: collections.Counter[tuple[str, int]] = collections.Counter()
        self.errors: list[str] = []

    def count(self, what: str, status: int) -> None:
        """Record one response (status -1: a transport error)."""
        self.by[(what, status)] += 1

    def statuses(self) -> dict[int, int]:
        """Responses by status."""
        out: collections.Counter[int] = collections.Counter()
        for (_, status), n in self.by.items():
            out[status] += n
        return dict(sorted(out.items()))


async def _client(c: httpx.AsyncClient, rng: random.Random, stop: float, tally: Tally, max_tokens: int) -> None:
    """Closed loop of requests over base, a1, a2, a3 and hot, half of them streamed."""
    while time.monotonic() < stop:
        model = rng.choice((None, *ADAPTERS, "hot"))
        body: dict[str, object] = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0}
        if model is not None:
            body["model"] = model
        what = model or "base"
        try:
            if rng.random() < 0.5:
                body["stream"] = True
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    text = await r.aread()
                    if r.status_code == 200 and b'"error"' in text:
                        tally.errors.append(text.decode()[-300:])
                    tally.count(what, r.status_code)
            else:
                r = await c.post("/v1/completions", json=body)
                tally.count(what, r.status_code)
                if r.status_code >= 500:
                    tally.errors.append(r.text[:300])
        except httpx.HTTPError as exc:
            tally.count(what, -1)
            tally.errors.append(repr(exc)[:300])


async def _churn(c: httpx.AsyncClient, folders: dict[str, Path], stop: float, interval: float, tally: Tally,
                 done: collections.Counter[str]) -> None:
    """Load hot, unload it half an interval later, and try three loads that must be refused."""
    while time.monotonic() < stop:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(folders["hot"])})
        tally.count("load", r.status_code)
        done["load"] += r.status_code == 200
        for name, path in (("bad-empty", folders["empty"]), ("bad-rank", folders["rank64"]), ("a1", folders["a1"])):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            tally.count("bad-load", r.status_code)
        await asyncio.sleep(interval / 2)
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
        tally.count("unload", r.status_code)
        done["unload"] += r.status_code == 200
        await asyncio.sleep(interval / 2)


def _rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (from /proc/PID/status), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _sample_rss(pid: int, stop: float, every: float, out: list[tuple[float, float]]) -> None:
    t0 = time.monotonic()
    while time.monotonic() < stop:
        rss = _rss_mib(pid)
        if rss is not None:
            out.append((time.monotonic() - t0, rss))
        await asyncio.sleep(every)


def _metrics(url: str) -> dict[str, float]:
    """Every stallfree_* sample of /metrics, by its full name with labels."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith("stallfree_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _soak(url: str, pid: int, folders: dict[str, Path], args: argparse.Namespace) -> dict[str, object]:
    tally = Tally()
    done: collections.Counter[str] = collections.Counter()
    rss: list[tuple[float, float]] = []
    stop = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as c:
        tasks = [_client(c, random.Random(args.seed + i), stop, tally, args.max_tokens) for i in range(args.clients)]
        tasks.append(_sample_rss(pid, stop, args.rss_interval, rss))
        if not args.no_churn:
            tasks.append(_churn(c, folders, stop, args.churn_interval, tally, done))
        await asyncio.gather(*tasks)
    deadline = time.monotonic() + 120
    m = _metrics(url)
    while time.monotonic() < deadline:
        m = _metrics(url)
        busy = [k for k, v in m.items() if v and k.startswith(("stallfree_num_requests_running",
                                                             "stallfree_num_requests_waiting",
                                                             "stallfree_lora_requests_active"))]
        if not busy:
            break
        await asyncio.sleep(0.5)
    end_rss = _rss_mib(pid)
    second_half = [v for t, v in rss if t >= args.duration / 2] or [v for _, v in rss]
    gauges = {k: v for k, v in m.items() if k.startswith(("stallfree_num_requests_running",
                                                          "stallfree_num_requests_waiting",
                                                          "stallfree_lora_requests_active",
                                                          "stallfree_lora_adapters_served"))}
    per_adapter = {k: v for k, v in m.items() if k.startswith(("stallfree_lora_loads_total",
                                                               "stallfree_lora_requests_total"))}
    statuses = tally.statuses()
    return {
        "duration_s": args.duration, "clients": args.clients,
        "statuses": statuses, "num_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "transport_errors": statuses.get(-1, 0), "stream_errors": len(tally.errors),
        "by_kind": {f"{w} {s}": n for (w, s), n in sorted(tally.by.items())},
        "loads": done["load"], "unloads": done["unload"],
        "gauges_at_end": gauges, "per_adapter": per_adapter,
        "rss_mib": {"first": rss[0][1] if rss else None, "end": end_rss,
                    "second_half_min": min(second_half) if second_half else None,
                    "second_half_max": max(second_half) if second_half else None, "samples": len(rss),
                    "by_tenth": [round(next((v for t, v in rss if t >= args.duration * k / 10), rss[-1][1]), 1)
                                 for k in range(11)] if rss else []},
        "errors": tally.errors[:5],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its report (JSON with --json); exit 1 when a check fails."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default 60)")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients (default 6)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request (default 8)")
    p.add_argument("--churn-interval", type=float, default=4.0, help="seconds per load + unload of hot (default 4)")
    p.add_argument("--no-churn", action="store_true",
                   help="no loads or unloads: the same traffic over base, a1, a2, a3 (hot is never served: 404s)")
    p.add_argument("--rss-interval", type=float, default=1.0, help="seconds between memory samples (default 1)")
    p.add_argument("--max-loras", type=int, default=2, help="the server's --max-loras (default 2)")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--token-budget", type=int, default=128)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-soak-") as tmp:
        folders = write_adapters(Path(tmp), args.model)
        extra = ("--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", "16",
                 "--lora-modules", *(f"{n}={folders[n]}" for n in ADAPTERS), "--max-waiting", "1024")
        with launched_process("model", args.token_budget, args, extra) as (url, proc):
            report = asyncio.run(_soak(url, proc.pid, folders, args))
    ok = (report["num_5xx"] == 0 and report["transport_errors"] == 0 and report["stream_errors"] == 0
          and not any(v for k, v in report["gauges_at_end"].items()  # type: ignore[union-attr]
                      if not k.startswith("stallfree_lora_adapters_served")))
    report["ok"] = ok
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
