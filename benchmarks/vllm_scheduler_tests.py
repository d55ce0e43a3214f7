"""vLLM's own scheduler tests against vLLM's scheduler and against stallfree's (stallfree.integrations.vllm).

Uses a CPU environment made by benchmarks/vllm_cpu/make_env.sh (one vLLM version, 0.33.0 or 0.34.0, its tests of
that version, offline model configs): `--build VERSION` makes it when DIR has none. Puts this checkout's src/ first on
PYTHONPATH (so two checkouts can share one environment, each testing its own code), then runs
tests/v1/core/test_scheduler.py and test_async_scheduler.py twice with the pytest plugin
benchmarks/vllm_sched_plugin.py: once as they are, once with vLLM's `Scheduler` / `AsyncScheduler` names
replaced by SyncScheduler / Scheduler. `--ours` also runs this project's tests/integrations/ there.

Printed: each run's collected / passed / failed / skipped; for ours, the tests that build our class, split
into passed, refused as unsupported (our class refused a feature by name), failing by design (BY_DESIGN below,
each with its reason; docs/vllm.md lists them), failing for the environment (they fail under vLLM's
scheduler too) and any other failure; and the goal's ratio: of the tests that build our class and pass with
vLLM's scheduler, the share that pass with ours (with and without the refused ones).

Usage:
    python benchmarks/vllm_scheduler_tests.py --env ~/.cache/stallfree-vllm-cpu [--build VERSION] [--ours] [-k EXPR]
        [--keep DIR] [--vllm-report VLLM_JSONL]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "vllm_cpu" / "make_env.sh"
TESTS = ["tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py"]

_LAST_TOKEN = (
    "a request whose last token is in flight is finished in the core, so never a preemption victim (vLLM preempts "
    "it: a KV producer recomputes it, a consumer takes the stale output)"
)

#: Tests of vLLM's (0.33's and 0.34's) that fail with our class by design: a name prefix -> the reason (docs/vllm.md).
BY_DESIGN: dict[str, str] = {
    "test_priority_scheduling_preemption": "an older running request is never preempted, even of lower priority",
    "test_priority_scheduling_preemption_and_resumption_when_out_of_kv": "an older running request is never "
    "preempted",
    "test_schedule_concurrent_partial_requests": "one partial prefill at a time (K = 1) unless "
    "max_num_partial_prefills is raised",
    "test_max_loras_counts_running_request_skipped_for_encoder_budget": "one partial prefill at a time (K = 1): "
    "a's first chunk stops at its second image (the encoder budget), so b does not start beside it",
    "test_long_prefill_threshold": "--long-prefill-token-threshold is T of the K/L/T rules, not a cap on every chunk",
    "test_schedule_order[False]": "prompts are always chunked (--no-enable-chunked-prefill is ignored)",
    "test_schedule_concurrent_batches": "the synchronous class expects each step's output before the next "
    "schedule() (no pipeline parallelism)",
    "test_preempt_during_execution": "the synchronous class expects each step's output before the next schedule()",
    "test_empty_schedule_does_not_advance_the_prefill_cadence": "the synchronous class expects each step's output "
    "before the next schedule() (a decode in flight is scheduled again)",
    "test_prefill_cadence_counts_executed_steps_not_schedule_calls": "the synchronous class expects each step's "
    "output before the next schedule() (a decode in flight is scheduled again)",
    "test_fcfs_mixed_blocked_types": "a request blocked at the head (a grammar still compiling) is not passed: "
    "admission is strictly in queue order",
    "test_pending_hisparse_reclamation": "a KV connector's pending block frees are not waited for: when vLLM has "
    "no block the core preempts by its victim rule (a decode never skips a step it fits in)",
    "test_kv_pressure_preempt_mid_handoff[kv_producer-False]": _LAST_TOKEN,
    "test_spec_decode_padding_first_decode_step": "a request admitted with one token left is not padded to 1 + k "
    "with placeholder drafts (drafts go to running decodes only)",
    "test_spec_decode_padding_resumed_request_without_running_requests": "a request admitted with one token left is "
    "not padded to 1 + k with placeholder drafts (drafts go to running decodes only)",
    "test_reset_prefix_cache_with_inflight_output_under_kv_pressure[3]": "a request preempted outside the core "
    "(reset_prefix_cache) is queued again once its in-flight output is back, so it is never re-preempted with a "
    "stale share pending",
    "test_kv_pressure_preempt_mid_handoff[kv_consumer-False]": _LAST_TOKEN,
    # vLLM 0.34's tests
    "test_mamba_decode_checkpoint_publication[False-stale-3]": "a request preempted outside the core "
    "(reset_prefix_cache) is queued again once its in-flight output is back, so it does not resume before the "
    "stale decode completes",
}


def _run(py: Path, vt: Path, env_sh: Path, swap: bool, report: Path, k: str | None) -> str:
    env = dict(os.environ)
    for line in env_sh.read_text().split():
        if "=" in line:
            key, _, value = line.partition("=")
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    env["STALLFREE_VLLM_REPORT"] = str(report)
    env["STALLFREE_VLLM_SWAP"] = "1" if swap else "0"
    cmd = [str(py), "-m", "pytest", *TESTS, "-q", "-p", "vllm_sched_plugin", "-p", "no:cacheprovider"]
    if k:
        cmd += ["-k", k]
    out = subprocess.run(cmd, cwd=vt, env=env, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]


def _load(path: Path) -> dict[str, dict]:
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            rows[d["test"]] = d
    return rows


def _reason(test: str) -> str | None:
    name = test.split("::", 1)[-1]
    for prefix, why in BY_DESIGN.items():
        if name.startswith(prefix):
            return why
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", type=Path, default=Path.home() / ".cache" / "stallfree-vllm-cpu")
    ap.add_argument("--build", metavar="VERSION",
                    help="build the environment for this vLLM version (0.33.0, 0.34.0) with make_env.sh if missing")
    ap.add_argument("--ours", action="store_true", help="also run tests/integrations/ in the environment")
    ap.add_argument("-k", help="pytest -k expression (both runs)")
    ap.add_argument("--keep", type=Path, help="folder for the two JSONL reports (default: a temporary one)")
    ap.add_argument("--from-reports", nargs=2, type=Path, metavar=("VLLM_JSONL", "OURS_JSONL"),
                    help="only count two reports written earlier (no test is run)")
    ap.add_argument("--vllm-report", type=Path, metavar="VLLM_JSONL",
                    help="reuse this report of vLLM's own scheduler (written by an earlier run) and run only ours")
    args = ap.parse_args()
    if args.from_reports:
        return _summarize(*args.from_reports)
    d = args.env.expanduser().resolve()
    py = d / "venv" / "bin" / "python"
    if not py.exists():
        if not args.build:
            print(f"no environment at {d}: run `bash {TOOL} VERSION {d}` (or pass --build VERSION)", file=sys.stderr)
            return 2
        subprocess.run(["bash", str(TOOL), args.build, str(d)], check=True)
    env_sh, vt = d / "env.sh", d / "vt"
    probe = subprocess.run([str(py), "-c", "import stallfree.integrations.vllm, stallfree; print(stallfree.__file__)"],
                           capture_output=True, text=True, cwd=vt, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if probe.returncode != 0 or not probe.stdout.startswith(str(ROOT)):
        print(f"cannot import this checkout's stallfree.integrations.vllm with {py}:\n{probe.stderr[-800:]}",
              file=sys.stderr)
        return 1
    keep = args.keep or Path(tempfile.mkdtemp(prefix="vllm-sched-tests-"))
    keep.mkdir(parents=True, exist_ok=True)
    rv, ro = keep / "vllm.jsonl", keep / "stallfree.jsonl"
    if args.vllm_report:
        rv = args.vllm_report.resolve()
    for p in (rv, ro) if not args.vllm_report else (ro,):
        p.unlink(missing_ok=True)
    if args.vllm_report:
        print("vLLM's scheduler:       (reused)", rv)
    else:
        print("vLLM's scheduler:      ", _run(py, vt, env_sh, False, rv, args.k))
    print("stallfree's scheduler: ", _run(py, vt, env_sh, True, ro, args.k))
    _summarize(rv, ro)
    if args.ours:
        env = dict(os.environ)
        for line in env_sh.read_text().split():
            if "=" in line:
                key, _, value = line.partition("=")
                env[key] = value
        env["PYTHONPATH"] = str(ROOT / "src")
        out = subprocess.run([str(py), "-m", "pytest", "tests/integrations", "-q", "-p", "no:cacheprovider",
                              "--noconftest", "-W", "ignore::DeprecationWarning"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        print("tests/integrations in the environment:", out.stdout.strip().splitlines()[-1:])
    return 0


def _summarize(rv: Path, ro: Path) -> int:
    """Print the counts of two reports (vLLM's run, ours)."""
    base, ours = _load(rv), _load(ro)
    for label, rows in (("vLLM's scheduler", base), ("stallfree's scheduler", ours)):
        outcomes = [r["outcome"] for r in rows.values()]
        print(f"{label}: collected {len(rows)}, passed {outcomes.count('passed')}, failed "
              f"{outcomes.count('failed')}, skipped {outcomes.count('skipped')}")
    built = {t: r for t, r in ours.items() if r["built"]}
    counts = {"passed": [], "refused": [], "by design": [], "environment": [], "other": []}
    for t, r in sorted(built.items()):
        b = base.get(t, {}).get("outcome")
        if r["outcome"] == "passed":
            counts["passed"].append(t)
        elif r["refused"]:
            counts["refused"].append(t)
        elif b != "passed":
            counts["environment"].append(t)
        elif _reason(t):
            counts["by design"].append(t)
        else:
            counts["other"].append(t)
    print(f"\ncollected {len(ours)} tests; {len(built)} build our class:")
    for key, ts in counts.items():
        print(f"  {key:12s} {len(ts)}")
    eligible = [t for t in built if base.get(t, {}).get("outcome") == "passed"]
    passed = [t for t in eligible if ours[t]["outcome"] == "passed"]
    # A test that refused a feature and still passed (the feature was incidental) counts as passed.
    not_refused = [t for t in eligible if ours[t]["outcome"] == "passed" or not ours[t]["refused"]]
    n_ref = len(eligible) - len(not_refused)
    print(f"\ngoal: of {len(eligible)} tests that build our class and pass with vLLM's scheduler, {len(passed)} pass "
          f"with ours ({100 * len(passed) / max(1, len(eligible)):.0f}%); leaving out the {n_ref} "
          f"refused as unsupported: {len(passed)} of {len(not_refused)} "
          f"({100 * len(passed) / max(1, len(not_refused)):.0f}%)")
    print("\nfailing by design:")
    for t in counts["by design"]:
        print(f"  {t.split('::', 1)[-1]}: {_reason(t)}")
    if counts["other"]:
        print("\nother failures:")
        for t in counts["other"]:
            print(f"  {t.split('::', 1)[-1]}: {ours[t]['error'][:160]!r}")
    print(f"\nreports: {rv} {ro}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
