"""Serve the fake engine as `stallfree serve` does (install_ops, run_server: signals, drain, limits), for
tests that run a server in a subprocess: `python tests/server/fake_serve.py --port P [serve's ops flags]`.

On exit it prints one JSON line to stdout: the engine's KV (free, total), whether it holds a request,
the requests it accepted, the outcome counters and the drain's summary, so a test can check that
every accepted request ended once and all KV came back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2] / "src")]

from server.fake_engine import FakeEngine, FakeSamplingParams  # noqa: E402
from stallfree.server import ServerConfig, create_app  # noqa: E402
from stallfree.server.ops import install_ops, run_server  # noqa: E402
from stallfree.server.options import add_ops_args, configure_logging, ops_from_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse the options, serve until a signal's drain ends it, print the final state; return the exit code."""
    p = argparse.ArgumentParser(prog="fake_serve.py")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-time", type=float, default=0.01, help="seconds per fake step")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    add_ops_args(p)
    args = p.parse_args(argv)
    ops, problem = ops_from_args(args)
    if ops is None:
        print(f"fake_serve.py: error: {problem}", file=sys.stderr)
        return 2
    configure_logging()
    eng = FakeEngine(max_seqs=args.max_seqs, kv_tokens=200_000, max_model_len=args.max_model_len,
                     step_time_s=args.step_time)
    app = create_app(eng, ServerConfig(sampling_params_cls=FakeSamplingParams, log_interval_s=0))
    drain = install_ops(app, ops)
    rc = run_server(app, "127.0.0.1", args.port, ops, log_level="warning")
    state = app.state.server
    outcomes = {r: state.metrics.registry.get_sample_value(
        "stallfree_request_success_total", {"model_name": "fake-model", "finished_reason": r}) or 0.0
        for r in ("stop", "length", "abort", "error")}
    print(json.dumps({"kv_free": eng.scheduler.kv_free, "kv_total": eng.scheduler.stats().kv_total,
                      "unfinished": eng.has_unfinished(), "added": len(eng.added), "outcomes": outcomes,
                      "summary": drain.summary}), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
