"""Soak test of the OpenAI-compatible server: concurrent streams, clients that disconnect, bad input and
bursts past the queue limit, for a bounded time; then the server must be idle and whole again.

For --duration seconds:
  * --clients streaming clients send requests in a closed loop (each sends its next when the previous
    ends) and record every gap between consecutive streamed tokens;
  * --disconnectors clients open a stream and close the connection after a few events;
  * one client sends bad input in a loop (malformed JSON, a lone surrogate, logprobs 0, an empty stop
    string, token ids outside the vocabulary, max_tokens past the context, an unknown route, n = 2,
    a body over the size limit, ...), each of which must be a 4xx;
  * every --burst-interval seconds, --burst-size requests arrive at once (past --max-waiting: 429s).
Then it waits for the server to go idle and reads /metrics.

It reports responses by status, the count of 5xx (must be 0), the worst token gap of a live stream,
the server's resident memory at start and end (from /proc, for a server it launched) and the gauges
(running, waiting, KV usage) at the end, which must be back to zero.

--api-key KEY runs the server with the key (passed in STALLFREE_API_KEY, so it stays out of the
process list); every client sends it, and the bad-input client also sends requests without it and with
a wrong one, each of which must be a 401.

--sigterm-after S adds a phase after the soak: --clients streams run again (half of them asking for
--sigterm-max-tokens tokens, more than --shutdown-timeout lets finish), the server gets SIGTERM S
seconds in, and the clients go on until it exits. It reports the requests in flight at the signal
that finished and that were aborted, the requests refused (503) during the drain, the server's exit
code and its last words (the drain's log line; for --server fake also the KV left).

--huge-body N measures one thing instead: while one stream runs, a body of N bytes (a prompt of that
many characters) is sent; it prints the time until that request was answered (and its status) and the
worst token gap of the stream around it, against the stream's median gap before.

Examples:
  python benchmarks/soak.py --server fake --duration 300 --clients 20
  python benchmarks/soak.py --server fake --duration 60 --api-key sk-soak --sigterm-after 3
  python benchmarks/soak.py --server model --huge-body 5000000

Imports allowed: the standard library, httpx and benchmarks/load.py (its server launcher).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import launched_process  # noqa: E402


@dataclass
class Stats:
    """What the clients saw. Gaps in seconds; statuses are HTTP codes (-1: a transport error)."""

    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter[int]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    worst_gap: float = 0.0
    worst_gap_at: float = 0.0
    errors: list[str] = field(default_factory=list)

    def count(self, kind: str, status: int) -> None:
        """Record one response of a client kind."""
        self.statuses[status] += 1
        self.by_kind.setdefault(kind, collections.Counter())[status] += 1


def _bad_bodies(max_request_bytes: int) -> list[tuple[str, str, bytes]]:
    """(label, path, raw body) of requests that must be refused with a 4xx."""

    def j(obj: object) -> bytes:
        return json.dumps(obj).encode()

    over = max_request_bytes + 1024
    return [
        ("malformed-json", "/v1/completions", b'{"prompt": '),
        ("not-an-object", "/v1/completions", b"[1, 2]"),
        ("lone-surrogate", "/v1/completions", b'{"prompt": "abc \\ud800", "max_tokens": 2}'),
        ("chat-surrogate", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
        ("logprobs-0", "/v1/completions", j({"prompt": "hi", "max_tokens": 2, "logprobs": 0})),
        ("stop-empty", "/v1/completions", j({"prompt": "hi", "max_tokens": 2, "stop": ""})),
        ("max-tokens-huge", "/v1/completions", j({"prompt": "hi", "max_tokens": 10**9})),
        ("token-id-out-of-vocab", "/v1/completions", j({"prompt": [10**9], "max_tokens": 2})),
        ("negative-token-id", "/v1/completions", j({"prompt": [-1], "max_tokens": 2})),
        ("n-2", "/v1/completions", j({"prompt": "hi", "max_tokens": 2, "n": 2})),
        ("empty-prompt", "/v1/completions", j({"prompt": "", "max_tokens": 2})),
        ("no-messages", "/v1/chat/completions", j({"messages": []})),
        ("temperature-neg", "/v1/completions", j({"prompt": "hi", "temperature": -1})),
        ("deep-json", "/v1/completions", b"[" * 50_000),
        ("unknown-route", "/v1/nothing-here", j({"prompt": "hi"})),
        ("over-size-limit", "/v1/completions", b'{"prompt": "' + b"a" * over + b'"}'),
        # issue 37: encodings, list lengths, mixed types, fields that would be dropped
        ("utf-16-surrogate", "/v1/completions",
         '{"prompt": "hi", "model": "\ud800"}'.encode("utf-16", "surrogatepass")),
        ("mixed-prompt", "/v1/completions", j({"prompt": [1, "a"], "max_tokens": 2})),
        ("many-stops", "/v1/completions", j({"prompt": "hi", "max_tokens": 2, "stop": ["x"] * 17})),
        ("message-name", "/v1/chat/completions",
         j({"messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2})),
    ]


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object], stats: Stats, kind: str,
                  close_after: int | None = None) -> None:
    """One streaming request; records token gaps (for kind "stream") and the status."""
    last: float | None = None
    events = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats.count(kind, r.status_code)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.errors.append(str(chunk["error"])[:200])
                    break
                now = time.perf_counter()
                if kind == "stream" and chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is not None:
                        gap = now - last
                        stats.gaps.append(gap)
                        if gap > stats.worst_gap:
                            stats.worst_gap, stats.worst_gap_at = gap, now
                    last = now
                if close_after is not None and events >= close_after:
                    break  # leaving the block closes the connection mid-stream
            stats.count(kind, r.status_code)
    except httpx.HTTPError as exc:
        stats.count(kind, -1)
        stats.errors.append(f"{kind}: {exc!r}"[:200])


async def _soak(url: str, args: argparse.Namespace) -> Stats:
    stats = Stats()
    rng = random.Random(args.seed)
    stop_at = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.clients + args.disconnectors + args.burst_size + 8)
    bad = _bad_bodies(args.max_request_bytes)

    def body(max_tokens: int) -> dict[str, object]:
        n = rng.randint(8, args.prompt_tokens)
        return {"prompt": [rng.randrange(100, 1000) for _ in range(n)], "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "temperature": 0.0}

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.duration + 120.0),
                                 headers=_auth(args)) as client:

        async def streamer() -> None:
            while time.perf_counter() < stop_at:
                await _stream(client, url, body(rng.randint(4, args.max_tokens)), stats, "stream")

        async def disconnector() -> None:
            while time.perf_counter() < stop_at:
                await _stream(client, url, body(args.max_tokens), stats, "disconnect",
                              close_after=rng.randint(1, 4))
                await asyncio.sleep(rng.uniform(0.05, 0.5))

        async def bad_input() -> None:
            i = 0
            while time.perf_counter() < stop_at:
                label, path, raw = bad[i % len(bad)]
                headers = {"content-type": "application/json"}
                if args.api_key and i % 3 == 2:  # a good body without the key, or with a wrong one: 401
                    label, path, raw = ("empty-authorization", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
                    if i % 2:
                        label, headers["authorization"] = "wrong-key", "Bearer sk-not-the-key"
                    else:
                        headers["authorization"] = ""
                i += 1
                try:
                    r = await client.post(url + path, content=raw, headers=headers)
                    stats.count("bad:" + label, r.status_code)
                except httpx.HTTPError as exc:
                    stats.count("bad:" + label, -1)
                    stats.errors.append(f"bad {label}: {exc!r}"[:200])
                await asyncio.sleep(args.bad_interval)

        async def bursts() -> None:
            while True:
                await asyncio.sleep(args.burst_interval)
                if time.perf_counter() >= stop_at:
                    return
                await asyncio.gather(*(_stream(client, url, body(8), stats, "burst")
                                       for _ in range(args.burst_size)))

        tasks = [streamer() for _ in range(args.clients)]
        tasks += [disconnector() for _ in range(args.disconnectors)]
        tasks += [bad_input(), bursts()]
        await asyncio.gather(*tasks)
    return stats


def _auth(args: argparse.Namespace) -> dict[str, str]:
    """The Authorization header every client sends (none without --api-key)."""
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _sigterm_phase(url: str, proc: subprocess.Popen[bytes], args: argparse.Namespace) -> dict[str, object]:
    """Streams, a SIGTERM after args.sigterm_after seconds, and streams until the server exits; the
    outcome of every request: finished / aborted (in flight at the signal) or refused / unreachable."""
    outcome: collections.Counter[str] = collections.Counter()
    rng = random.Random(args.seed + 1)
    signalled: list[float] = []

    async def one(client: httpx.AsyncClient, max_tokens: int) -> None:
        before = not signalled
        body = {"prompt": [rng.randrange(100, 1000) for _ in range(rng.randint(8, args.prompt_tokens))],
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0}
        when = "sent after SIGTERM"
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    code = r.json().get("error", {}).get("code") if r.status_code == 503 else None
                    outcome[f"{when}: {r.status_code}" + (f" {code}" if code else "")] += 1
                    return
                last = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = line
                kind = "aborted (error event)" if '"error"' in last else "finished"
                if before:
                    when = "in flight at SIGTERM" if signalled else "ended before SIGTERM"
                outcome[f"{when}: {kind}"] += 1
        except httpx.ConnectError:
            outcome[f"{when}: connection refused (the server had closed its socket)"] += 1
            await asyncio.sleep(0.05)
        except httpx.HTTPError as exc:
            outcome[f"{when}: transport error {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        while proc.poll() is None:
            await one(client, args.sigterm_max_tokens if i % 2 else rng.randint(4, args.max_tokens))

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.shutdown_timeout + 120.0), headers=_auth(args),
                                 limits=httpx.Limits(max_connections=args.clients + 8)) as client:
        tasks = [asyncio.ensure_future(client_loop(client, i)) for i in range(args.clients)]
        await asyncio.sleep(args.sigterm_after)
        signalled.append(time.perf_counter())
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, args.shutdown_timeout + 120.0)
        exited = time.perf_counter() - signalled[0]
        await asyncio.gather(*tasks)
    log = Path(getattr(proc, "log_path", "")).read_text() if getattr(proc, "log_path", None) else ""
    words = [ln for ln in log.splitlines() if "shutdown:" in ln or ln.startswith("{")]
    return {"exit_code": rc, "exit_after_sigterm_s": round(exited, 2),
            "outcomes": dict(sorted(outcome.items())), "server_said": words[-3:],
            "server_log": getattr(proc, "log_path", None)}


def _rss_mib(pid: int | None) -> float | None:
    """Resident memory of a process in MiB (from /proc/PID/status), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _gauges(url: str) -> dict[str, float]:
    """The engine gauges and outcome counters from /metrics (name, or name{reason} -> value)."""
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in ("stallfree_num_requests_running", "stallfree_num_requests_waiting",
                     "stallfree_kv_cache_usage_ratio", "stallfree_request_success_total",
                     "stallfree_preemptions_total", "stallfree_requests_refused_total"):
            if line.startswith(name):
                key, value = line.rsplit(" ", 1)
                reason = key.split('finished_reason="')[1].split('"')[0] if "finished_reason" in key else ""
                out[name + (f"{{{reason}}}" if reason else "")] = float(value)
    return out


def _wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        g = _gauges(url)
        idle = (g.get("stallfree_num_requests_running", 1) == 0 and g.get("stallfree_num_requests_waiting", 1) == 0
                and g.get("stallfree_kv_cache_usage_ratio", 1) == 0)
        if idle or time.monotonic() > deadline:
            return g
        time.sleep(0.5)


async def _huge(url: str, args: argparse.Namespace) -> dict[str, float]:
    """Stream while one body of args.huge_body bytes is sent; time its answer and the stream's gaps."""
    stats = Stats()
    body = {"prompt": "Count slowly: one, two,", "max_tokens": args.huge_stream_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    raw = b'{"prompt": "' + b"a " * (args.huge_body // 2) + b'", "max_tokens": 4}'
    result: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        stream = asyncio.ensure_future(_stream(client, url, body, stats, "stream"))
        await asyncio.sleep(args.huge_warmup)
        before = list(stats.gaps)
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        result["huge_status"] = r.status_code
        result["huge_answer_s"] = time.perf_counter() - t0
        await asyncio.sleep(args.huge_warmup)
        window = stats.gaps[len(before):]
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    result["body_bytes"] = len(raw)
    result["median_gap_before_s"] = statistics.median(before) if before else float("nan")
    result["worst_gap_during_s"] = max(window) if window else float("nan")
    result["tokens_during"] = len(window)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the soak (or the huge-body measurement); print the figures; optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="fake", help="fake | model | an http://127.0.0.1:PORT URL")
    p.add_argument("--model", default=None, help="model path for --server model (default: bundled)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--clients", type=int, default=20, help="concurrent streaming clients (default 20)")
    p.add_argument("--disconnectors", type=int, default=4, help="clients that leave mid-stream (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="longest prompt, tokens (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="longest completion, tokens (default 64)")
    p.add_argument("--burst-size", type=int, default=40, help="requests per burst (default 40)")
    p.add_argument("--burst-interval", type=float, default=20.0, help="seconds between bursts (default 20)")
    p.add_argument("--bad-interval", type=float, default=0.2, help="seconds between bad requests (default 0.2)")
    p.add_argument("--max-waiting", type=int, default=16, help="the server's --max-waiting (default 16)")
    p.add_argument("--max-request-bytes", type=int, default=2 * 1024 * 1024,
                   help="the server's body limit, for the over-limit request (default 2 MiB)")
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--huge-body", type=int, default=None, metavar="BYTES",
                   help="measure one body of this size against a live stream instead of soaking")
    p.add_argument("--huge-stream-tokens", type=int, default=400)
    p.add_argument("--huge-warmup", type=float, default=4.0, help="seconds of stream before and after")
    p.add_argument("--api-key", default=None, help="run the server with this key; clients send it")
    p.add_argument("--sigterm-after", type=float, default=None, metavar="S",
                   help="after the soak, a phase with a SIGTERM S seconds into new load (launched servers)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="the server's --shutdown-timeout, seconds (default 5)")
    p.add_argument("--sigterm-max-tokens", type=int, default=2000,
                   help="max_tokens of half the streams of the SIGTERM phase (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    if not 0 < args.duration <= 3600 or not 1 <= args.clients <= 256:
        p.error("--duration must be in (0, 3600] seconds and --clients in 1..256")

    extra = ("--max-waiting", str(args.max_waiting), "--shutdown-timeout", str(args.shutdown_timeout))
    if args.server == "fake":
        extra += ("--max-model-len", "4096")
    if args.api_key:
        args.server_env = {"STALLFREE_API_KEY": args.api_key}  # out of the process list
    if args.sigterm_after is not None and args.server not in ("fake", "model"):
        p.error("--sigterm-after needs a server this script launches (--server fake or model)")
    report: dict[str, object] = {}
    if args.server in ("fake", "model"):
        ctx = launched_process(args.server, args.token_budget, args, extra)
    else:
        ctx = _external(args.server.rstrip("/"))
    with ctx as (url, proc):
        pid = proc.pid if proc is not None else None
        if args.huge_body is not None:
            report = asyncio.run(_huge(url, args))
            for k, v in report.items():
                print(f"{k:24s} {v}")
        else:
            report["rss_start_mib"] = _rss_mib(pid)
            t0 = time.perf_counter()
            stats = asyncio.run(_soak(url, args))
            report["wall_s"] = time.perf_counter() - t0
            report["gauges_end"] = _wait_idle(url)
            report["rss_end_mib"] = _rss_mib(pid)
            report["statuses"] = dict(sorted(stats.statuses.items()))
            report["by_kind"] = {k: dict(sorted(v.items())) for k, v in sorted(stats.by_kind.items())}
            report["num_5xx"] = sum(n for s, n in stats.statuses.items() if s >= 500)
            report["transport_errors"] = stats.statuses.get(-1, 0)
            report["token_gaps"] = len(stats.gaps)
            report["median_gap_ms"] = 1e3 * statistics.median(stats.gaps) if stats.gaps else None
            report["worst_gap_ms"] = 1e3 * stats.worst_gap
            report["error_samples"] = stats.errors[:5]
            if args.sigterm_after is not None:
                assert proc is not None
                report["sigterm"] = asyncio.run(_sigterm_phase(url, proc, args))
            print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report.get("num_5xx", 0) == 0 else 1


class _external:
    """A context manager that yields (url, None) for a server already running."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> tuple[str, None]:
        return self.url, None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
