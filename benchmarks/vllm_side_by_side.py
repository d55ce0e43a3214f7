"""vLLM's own scheduler and stallfree's inside vLLM, side by side on the CPU with a fake model runner.

Two measurements, in the environment of benchmarks/vllm_cpu/make_env.sh (vLLM 0.33 or 0.34, CPU torch, offline
model configs):

- `--workload` (default): long prompts among short ones. 64 short requests (prompts 64-512 tokens, outputs
  64-256, Poisson arrivals at 4/s) and 4 long prompts (12k-24k tokens, outputs 64) at seeded times in the first
  12 s; Qwen/Qwen3-0.6B's config (max_model_len 32768), budget 2048 tokens, 64 sequences, KV for everything.
  Each step's tokens come from the scheduler (vLLM's SchedulerOutput); its duration is priced by stallfree's
  default cost model (Llama 3.1 8B on one H100 SXM, bf16: the plan's decodes, their contexts and the prefill
  chunks with their offsets), and a simulated clock advances by it. Reported per scheduler: steps, TTFT
  p50/p99 of the short prompts and p50 of the long ones, TPOT p50/p99 (requests with >= 2 tokens), the
  longest step, the largest prefill share of a step that carried decodes, and the makespan.
- `--cost`: the scheduler's own cost per step on this CPU: N requests all decoding (N = 256 and 1,024), the
  median over 5 interleaved repeats of the mean wall time of schedule() and of update_from_output() over 50
  steps, for both schedulers in the same process.

Usage:
    . DIR/env.sh && DIR/venv/bin/python benchmarks/vllm_side_by_side.py [--workload] [--cost] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import default_cost_model
from stallfree.integrations import vllm as sv
from stallfree.integrations.vllm import harness

BUDGET = 2048
MAX_SEQS = 64
MODEL = "Qwen/Qwen3-0.6B"
MAX_MODEL_LEN = 32768


def build_workload(seed: int) -> list[tuple[float, str, int, int]]:
    """(arrival seconds, rid, prompt_len, max_tokens), sorted by arrival."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(64):
        t += rng.expovariate(4.0)
        out.append((t, f"s{i}", rng.randint(64, 512), rng.randint(64, 256)))
    for i in range(4):
        out.append((rng.uniform(0.0, 12.0), f"L{i}", rng.randint(12_000, 24_000), 64))
    return sorted(out)


def to_plan(out: Any, requests: dict[str, Any], step: int) -> StepPlan:
    """The StepPlan of a vLLM SchedulerOutput (after schedule(): num_computed_tokens already advanced)."""
    rids, offsets, prefills = [], [], []
    ctx = 0
    for rid, n in out.num_scheduled_tokens.items():
        r = requests[rid]
        start = r.num_computed_tokens - n
        if n == 1 and start == r.num_tokens - 1 and start >= r.num_prompt_tokens:
            rids.append(rid)
            offsets.append(start - step)
            ctx += start
        else:
            prefills.append(ScheduledChunk(rid, n, True, start, start + n >= r.num_tokens))
    return StepPlan(step, tuple(rids), tuple(offsets), tuple(prefills), out.total_num_scheduled_tokens, ctx, BUDGET)


def run_workload(cls: type, extra: dict[str, Any] | None, long_thr: int, seed: int) -> dict[str, float]:
    """Run the workload through scheduler class `cls` on a simulated clock; return its figures."""
    cost = default_cost_model("llama-3.1-8b", "h100-sxm").cost_model
    s = harness.make_scheduler(cls, model=MODEL, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                               num_blocks=40_000, max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=long_thr,
                               additional_config=extra)
    work = build_workload(seed)
    arrival = {rid: t for t, rid, _, _ in work}
    prompt = {rid: p for _, rid, p, _ in work}
    pending = list(work)
    clock = 0.0
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    ntok: dict[str, int] = {}
    steps = 0
    longest = 0.0
    worst_share = 0.0
    preemptions = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= clock:
            _, rid, p, m = pending.pop(0)
            s.add_request(harness.make_request(rid, p, m, arrival=arrival[rid]))
        if not s.has_unfinished_requests():
            clock = pending[0][0]
            continue
        out = s.schedule()
        preemptions += len(out.preempted_req_ids or ())
        plan = to_plan(out, s.requests, steps)
        dt = cost.step_time(plan)
        if dt <= 0.0:
            if not pending:
                raise RuntimeError("scheduler stalled with requests left")
            clock = max(clock, pending[0][0])
        clock += dt
        longest = max(longest, dt)
        if plan.num_decodes and plan.prefills:
            worst_share = max(worst_share, plan.num_prefill_tokens / plan.num_tokens)
        steps += 1
        result = s.update_from_output(out, harness.fake_model_output(out, s.requests))
        for outs in result.values():
            for o in outs.outputs:
                if o.new_token_ids:
                    first.setdefault(o.request_id, clock)
                    ntok[o.request_id] = ntok.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    done[o.request_id] = clock
    short = sorted(first[r] - arrival[r] for r in first if prompt[r] < 1024)
    long_ = sorted(first[r] - arrival[r] for r in first if prompt[r] >= 1024)
    tpot = sorted((done[r] - first[r]) / (ntok[r] - 1) for r in done if ntok[r] >= 2)
    return {
        "steps": steps, "short_ttft_p50": _q(short, 0.5), "short_ttft_p99": _q(short, 0.99),
        "long_ttft_p50": _q(long_, 0.5), "tpot_p50": _q(tpot, 0.5), "tpot_p99": _q(tpot, 0.99),
        "longest_step": longest, "prefill_share": worst_share, "makespan": clock,
        "preemptions": preemptions,
    }


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cost_per_step(cls: type, n: int, steps: int = 50) -> tuple[float, float]:
    """Mean seconds of schedule() and of update_from_output() over `steps` steps with `n` requests decoding."""
    s = harness.make_scheduler(cls, max_num_seqs=n, max_num_batched_tokens=max(2048, n), num_blocks=10 * n + 64,
                               max_model_len=2048)
    for i in range(n):
        s.add_request(harness.make_request(f"r{i}", 16, 1000))
    while True:  # until every request decodes
        out = s.schedule()
        s.update_from_output(out, harness.fake_model_output(out, s.requests))
        if len(out.num_scheduled_tokens) == n and out.total_num_scheduled_tokens == n:
            break
    t_sched = t_upd = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        mro = harness.fake_model_output(out, s.requests)
        t2 = time.perf_counter()
        s.update_from_output(out, mro)
        t3 = time.perf_counter()
        assert out.total_num_scheduled_tokens == n
        t_sched += t1 - t0
        t_upd += t3 - t2
    return t_sched / steps, t_upd / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", action="store_true", help="the long-prompts-among-short table")
    ap.add_argument("--cost", action="store_true", help="the cost per step at 256 and 1,024 running")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.workload or args.cost):
        args.workload = args.cost = True
    if args.workload:
        rows = [
            ("vLLM Scheduler (defaults)", VllmScheduler, None, 0),
            ("vLLM Scheduler, --long-prefill-token-threshold 512", VllmScheduler, None, 512),
            ("stallfree SyncScheduler (K=1)", sv.SyncScheduler, None, 0),
            ("stallfree SyncScheduler (K=4, L=1, T=512)", sv.SyncScheduler,
             {"stallfree": {"max_num_partial_prefills": 4, "long_prefill_token_threshold": 512}}, 0),
        ]
        print(default_cost_model("llama-3.1-8b", "h100-sxm").provenance)
        print(f"workload seed {args.seed}: 64 short (64-512 tok) + 4 long (12k-24k tok) prompts; budget {BUDGET}, "
              f"{MAX_SEQS} seqs; steps priced as Llama 3.1 8B on 1 x H100 SXM (stallfree's default cost model)")
        print("| scheduler | steps | short TTFT p50 / p99 (s) | long TTFT p50 (s) | TPOT p50 / p99 (ms) | "
              "longest step (ms) | max prefill share of a decode step | makespan (s) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, cls, extra, thr in rows:
            r = run_workload(cls, extra, thr, args.seed)
            print(f"| {label} | {r['steps']:.0f} | {r['short_ttft_p50']:.3f} / {r['short_ttft_p99']:.3f} | "
                  f"{r['long_ttft_p50']:.2f} | {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} | "
                  f"{r['longest_step'] * 1e3:.1f} | {r['prefill_share']:.2f} | {r['makespan']:.2f} |")
    if args.cost:
        print("\ncost per step on this CPU (median of 5 interleaved repeats of the mean over 50 steps), microseconds")
        print("| running | vLLM schedule() | stallfree schedule() | vLLM update_from_output() | "
              "stallfree update_from_output() |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for n in (256, 1024):
            got: dict[str, list[tuple[float, float]]] = {"vllm": [], "sf": []}
            for _ in range(5):
                got["vllm"].append(cost_per_step(VllmScheduler, n))
                got["sf"].append(cost_per_step(sv.SyncScheduler, n))
            med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in got.items()}
            print(f"| {n} | {med['vllm'][0] * 1e6:.0f} | {med['sf'][0] * 1e6:.0f} | {med['vllm'][1] * 1e6:.0f} | "
                  f"{med['sf'][1] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
