"""The faults of issue 37, each sent to a real server while one stream runs beside it: what each request is
answered, how long it took, and the stream's worst gap between tokens during it.

For each case: a stream (--stream-tokens tokens, greedy, ignore_eos) starts; after --settle-s seconds its
median gap is the "quiet" figure; then the case's requests are sent at once (--copies of each, in
threads) and the worst gap of the stream while they were in flight is recorded, with whether the stream
itself still ended well. Cases:
  temperature  {"prompt": "x", "max_tokens": 1, "temperature": 1e-40}
  token-list   {"prompt": [1, 2, ..., 249999, "a"]}                     (1.9 MB)
  long-text    {"prompt": "x" * 663000}                                 (a prompt without spaces)
  stops        {"prompt": "hi", "max_tokens": 16, "stop": [190,000 short strings]} (1.99 MB)
  utf-16       a body in UTF-16 whose model name is a lone surrogate (so not served)
  te-and-cl    Transfer-Encoding: chunked and Content-Length together
  expect-100   Expect: 100-continue with a declared body over the limit (is 100 Continue sent first?)
  name         messages[0].name "bob"
  mixed-type   {"prompt": [1, "a"]}                                    (small: the control)

--server fake serves the tests' fake engine instead (steps that sleep, releasing the GIL), so that the
gaps show what the server's own work on the requests costs, apart from the model's compute.

--src DIR serves the code in DIR (a checkout's src/), so that one run measures before and after alike:
  python benchmarks/faults.py --src /tmp/before/src --json before.json
  python benchmarks/faults.py --json after.json

Imports allowed: the standard library, httpx and benchmarks/load.py (its server start and stop).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, served  # noqa: E402  (the server start and stop every serving benchmark shares)


@contextlib.contextmanager
def server(src: Path, extra: list[str], startup_s: float, kind: str = "model") -> Iterator[str]:
    """Run `stallfree serve` (kind "model") or benchmarks/load.py's fake-engine server (kind "fake": steps
    that sleep, so gaps show the server's own cost) from `src` on a free loopback port; yield its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT / "tests")])}
    if kind == "fake":
        cmd = [sys.executable, str(ROOT / "benchmarks" / "load.py"), "_fake_server", "--port", str(port),
               "--token-budget", "512", "--max-model-len", "8192", *extra]
    else:
        cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--log-interval", "0", *extra]
    with served(cmd, env, port, startup_s, log_prefix="stallfree-faults-", stop_s=10.0) as (url, _proc):
        yield url


def _stream_process(url: str, body: dict[str, Any], out: Any) -> None:
    """Read one stream and send back (arrival times, finish_reason, saw an error event)."""
    times: list[float] = []
    finish, error = None, False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())  # CLOCK_MONOTONIC: comparable across processes
                if line.startswith('data: {"error"'):
                    error = True
                elif '"finish_reason":"' in line:
                    finish = line.split('"finish_reason":"', 1)[1].split('"', 1)[0]
    out.put((times, finish, error))


class Stream:
    """One streamed completion read by its own process (so that the senders' threads never delay its
    reads), recording the arrival time of every SSE event."""

    def __init__(self, url: str, tokens: int) -> None:
        self.times: list[float] = []
        self.finish: str | None = None
        self.error = False
        body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        ctx = multiprocessing.get_context("fork")
        self._queue = ctx.Queue()
        self._proc = ctx.Process(target=_stream_process, args=(url, body, self._queue), daemon=True)
        self._proc.start()
        self._start = time.perf_counter()

    def wait(self, timeout_s: float) -> None:
        """Wait for the stream to end and collect its figures."""
        self.times, self.finish, self.error = self._queue.get(timeout=timeout_s)
        self._proc.join(5)

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps (s) between consecutive events whose interval overlaps [start, end]."""
        t = self.times
        return [b - a for a, b in zip(t, t[1:], strict=False) if b >= start and a <= end]


def _post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json", **(headers or {})},
                       timeout=120)
        return r.status_code, time.perf_counter() - t0, r.text
    except httpx.HTTPError as exc:
        return -1, time.perf_counter() - t0, repr(exc)


def _raw(url: str, head: str, body: bytes = b"") -> tuple[int, float, str]:
    host, port = url.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    got = b""
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(head.encode())
        if b"100-continue" not in head.encode().lower():
            sock.sendall(body)
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := sock.recv(65536):
                got += chunk
                if b"100-continue" in head.encode().lower() and got.startswith(b"HTTP/1.1 100"):
                    sock.sendall(body)  # the server asked for it: it would read the whole body
    text = got.decode("latin-1")
    status = int(text.split(" ", 2)[1]) if text.startswith("HTTP/") else -1
    if status == 100:
        status = int(text.split("HTTP/1.1 ", 2)[2][:3])
        text = "100 Continue first; then " + text.split("\r\n\r\n", 1)[1]
    return status, time.perf_counter() - t0, text


def cases(url: str) -> dict[str, Callable[[], tuple[int, float, str]]]:
    """name -> a function sending one request of that case."""
    port = url.rsplit(":", 1)[1]
    token_list = json.dumps({"prompt": [*range(1, 250_000), "a"]}).encode()
    long_text = json.dumps({"prompt": "x" * 663_000}).encode()
    stops = json.dumps({"prompt": "hi", "max_tokens": 16, "ignore_eos": True,
                        "stop": [f"{i:05d}q" for i in range(190_000)]}).encode()
    # A lone surrogate written straight in UTF-16 (json.loads decodes bytes with surrogatepass).
    utf16 = '{"prompt": "hi", "model": "\ud800"}'.encode("utf-16", "surrogatepass")
    small = b'{"prompt": "hi", "max_tokens": 2}'
    chunked = f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return {
        "temperature": lambda: _post(url, "/v1/completions",
                                     b'{"prompt": "x", "max_tokens": 1, "temperature": 1e-40}'),
        "token-list": lambda: _post(url, "/v1/completions", token_list),
        "long-text": lambda: _post(url, "/v1/completions", long_text),
        "stops": lambda: _post(url, "/v1/completions", stops),
        "utf-16": lambda: _post(url, "/v1/completions", utf16),
        "te-and-cl": lambda: _raw(url, head + f"Transfer-Encoding: chunked\r\nContent-Length: {len(small)}\r\n"
                                  "Connection: close\r\n\r\n", chunked),
        "expect-100": lambda: _raw(url, head + "Content-Length: 3000000\r\nExpect: 100-continue\r\n"
                                   "Connection: close\r\n\r\n", b"x" * 3_000_000),
        "name": lambda: _post(url, "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2}).encode()),
        "mixed-type": lambda: _post(url, "/v1/completions", b'{"prompt": [1, "a"]}'),
    }


def measure(url: str, name: str, send: Callable[[], tuple[int, float, str]], copies: int,
            stream_tokens: int, settle_s: float) -> dict[str, Any]:
    """Run one case beside a fresh stream; return its figures."""
    stream = Stream(url, stream_tokens)
    time.sleep(settle_s)
    quiet_end = time.perf_counter()
    results: list[tuple[int, float, str]] = []
    threads = [threading.Thread(target=lambda: results.append(send())) for _ in range(copies)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    stream.wait(180)
    quiet = stream.gaps(0, quiet_end)
    during = stream.gaps(start, end)
    return {
        "case": name, "copies": copies,
        "statuses": sorted(r[0] for r in results),
        "median_answer_s": round(statistics.median(r[1] for r in results), 3),
        "answer_bytes": max(len(r[2]) for r in results),
        "answer": results[0][2][:160],
        "quiet_median_gap_s": round(statistics.median(quiet), 4) if quiet else None,
        "worst_gap_during_s": round(max(during), 4) if during else round(end - start, 4),
        "stream_ended_well": not stream.error and stream.finish == "length",
    }


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print one JSON line per case (and write them to --json)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=ROOT / "src", help="the src/ directory to serve (default: this one)")
    p.add_argument("--server", choices=("model", "fake"), default="model",
                   help="model: stallfree serve with the bundled model (default); fake: the fake engine")
    p.add_argument("--cases", nargs="+", default=None, help="cases to run (default: all)")
    p.add_argument("--copies", type=int, default=4, help="requests of each case sent at once (default 4)")
    p.add_argument("--stream-tokens", type=int, default=200, help="tokens of the stream beside (default 200)")
    p.add_argument("--settle-s", type=float, default=1.5, help="seconds of quiet stream first (default 1.5)")
    p.add_argument("--startup-s", type=float, default=180.0, help="seconds to wait for the server")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("serve_args", nargs="*", help="extra `stallfree serve` options (after --)")
    args = p.parse_args(argv)
    out = []
    with server(args.src, args.serve_args, args.startup_s, args.server) as url:
        all_cases = cases(url)
        for name in args.cases or list(all_cases):
            copies = 1 if name in ("utf-16", "te-and-cl", "expect-100", "name") else args.copies
            row = measure(url, name, all_cases[name], copies, args.stream_tokens, args.settle_s)
            print(json.dumps(row), flush=True)
            out.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
