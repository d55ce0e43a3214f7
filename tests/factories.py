"""Factories for schedulers and request mixes used across the tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from stallfree import Request, Scheduler
from stallfree.core.invariants import InvariantChecker


def make_scheduler(
    token_budget: int = 8, max_seqs: int = 4, kv_tokens: int = 1000, **kw: object
) -> Scheduler:
    """A Scheduler with small defaults (budget 8, 4 slots, 1,000 KV tokens)."""
    return Scheduler(token_budget=token_budget, max_seqs=max_seqs, kv_tokens=kv_tokens, **kw)


def make_requests(n: int, prompt_len: int = 4, max_new: int = 3, start: int = 0) -> list[Request]:
    """`n` identical requests with rids start, start+1, ..."""
    return [Request(rid=start + i, prompt_len=prompt_len, max_new=max_new) for i in range(n)]


def run_to_end(sched: Scheduler, arrivals: dict[int, list[Request]] | None = None, max_steps: int = 10_000):
    """Step `sched` until nothing is unfinished; return {step: [(rid, tokens), ...]} and finish steps."""
    arrivals = arrivals or {}
    plans: dict[int, list[tuple[Hashable, int]]] = {}
    finish: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    while sched.has_unfinished() or sched.step <= max(arrivals, default=-1):
        for req in arrivals.get(sched.step, []):
            sched.add(req)
        plan = sched.schedule()
        plans[plan.step] = [(c.rid, c.num_tokens) for c in plan]
        for c in plan.prefills:
            if c.is_last:
                first[c.rid] = plan.step
        sched.complete(plan)
        for rid in sched.last_finished:
            finish[rid] = plan.step
        if sched.step > max_steps:
            raise AssertionError("did not terminate")
    return plans, first, finish


@dataclass
class RandomWorkload:
    """A seeded random simulation: config, staggered arrivals, aborts and early stops."""

    seed: int
    num_requests: int = 40
    options: dict[str, object] | None = None
    vary_budget: bool = False

    def run(self, make: Callable[..., Scheduler] = make_scheduler) -> InvariantChecker:
        """Drive a checked scheduler to the end; return the checker (it counts steps and requests)."""
        rng = random.Random(self.seed)
        options = dict(self.options or {})
        floor = int(options.get("block_size") or 1)  # type: ignore[call-overload]
        budget = max(floor, rng.choice([1, 2, 3, rng.randint(1, 16), rng.randint(1, 256)]))
        max_seqs = rng.randint(1, 11)
        reqs = [
            Request(rid=i, prompt_len=rng.randint(1, 299), max_new=rng.randint(1, 64))
            for i in range(self.num_requests)
        ]
        largest = max(-(-(r.prompt_len + r.max_new) // floor) * floor for r in reqs)
        kv = rng.choice([largest, largest + rng.randint(0, largest), largest * 20])
        spec = bool(options.get("num_spec_tokens"))
        reqs = [
            Request(r.rid, r.prompt_len, r.max_new, priority=rng.randint(0, 3)) if options.get("policy") else r
            for r in reqs
        ]
        chk = InvariantChecker(make(budget, max_seqs, kv, **options))
        arrive = sorted(rng.randint(0, 200) for _ in reqs)
        p_abort, p_stop = rng.choice([0.0, 0.02]), rng.choice([0.0, 0.05])
        i = 0
        while i < len(reqs) or chk.scheduler.has_unfinished():
            while i < len(reqs) and arrive[i] <= chk.scheduler.step:
                chk.add(reqs[i])
                i += 1
            live = [r.rid for r in reqs[:i]]
            if p_abort and live and rng.random() < p_abort * 5:
                rid = rng.choice(live)
                chk.abort(rid)  # finished rids are no-ops
            step_budget = rng.randint(1, budget) if self.vary_budget and rng.random() < 0.5 else None
            plan = chk.schedule(step_budget)
            if p_abort and plan and rng.random() < p_abort * 5:
                chk.abort(rng.choice([c.rid for c in plan]))  # in flight: deferred to complete()
            stopped = [r for r in plan.sampled_rids if rng.random() < p_stop]
            accepted = {c.rid: rng.randint(1, c.num_tokens) for c in plan.decodes} if spec else None
            chk.complete(plan, stopped, accepted)
            if chk.scheduler.step > 100_000:
                raise AssertionError("did not terminate")
        chk.check_final()
        return chk


def drive_randomly(chk, sched, reqs: list[Request], arrive: list[int], rng: random.Random, p_abort: float,
                   p_stop: float, abort_in_flight: bool = False) -> None:
    """Run `chk` (an invariant checker around `sched`) until every request is done: request i arrives at step
    arrive[i] (sorted); with probability p_abort per step an arrived request is aborted (a finished rid is a
    no-op) and, with `abort_in_flight`, one of the plan in flight too (deferred to complete()); each sampled
    request stops early with probability p_stop. Ends with check_final(). The rng is drawn in that order, so
    a seeded run is the same run wherever it is driven from."""
    i = 0
    while i < len(reqs) or sched.has_unfinished():
        while i < len(reqs) and arrive[i] <= sched.step:
            chk.add(reqs[i])
            i += 1
        if p_abort and i and rng.random() < p_abort:
            chk.abort(rng.choice(reqs[:i]).rid)
        plan = chk.schedule()
        if abort_in_flight and p_abort and plan and rng.random() < p_abort:
            chk.abort(rng.choice(list(plan)).rid)
        chk.complete(plan, [r for r in plan.sampled_rids if rng.random() < p_stop])
    chk.check_final()


def run_engine(eng, schedule, params) -> dict:
    """schedule: (step, rid, token_ids) triples; add each to `eng` (an LLMEngine) at its step with `params`,
    step to the end; returns the generated token ids per rid."""
    out: dict = {}
    step = 0
    pending = sorted(schedule, key=lambda x: x[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids = pending.pop(0)
            eng.add_request(rid, ids, params)
            out[rid] = []
        for o in eng.step():
            out[o.rid].extend(o.new_token_ids)
        step += 1
    return out


def random_lora_run(seed: int, kv_policy: str, num_requests: int = 40) -> InvariantChecker:
    """One seeded random run with adapters under the checker: a budget, slots, KV (tight to generous),
    max_loras 1-4 over 1-8 adapters (some requests on the base model), max_lora_passes 0-8, and per seed
    one of: plain FCFS, priority with aging, K=3 partial prefills, block-aligned chunks, prefix caching
    (paged); random aborts and early stops. Returns the checker after check_final()."""
    rng = random.Random(seed)
    budget = rng.choice([1, 3, rng.randint(4, 16), rng.randint(16, 256)])
    max_seqs = rng.randint(1, 11)
    names = [f"L{i}" for i in range(rng.randint(1, 8))]
    reqs = [Request(rid=i, prompt_len=rng.randint(1, 200), max_new=rng.randint(1, 40),
                    priority=rng.randint(0, 3), lora=rng.choice([None, *names, *names]))
            for i in range(num_requests)]
    opts: dict[str, object] = dict(max_loras=rng.randint(1, 4), max_lora_passes=rng.randint(0, 8))
    variant = rng.choice(["fcfs", "priority", "partial", "aligned", "cache"])
    bs = 4
    if kv_policy == "paged":
        opts.update(kv_policy="paged", block_size=bs)
    if variant == "priority":
        opts.update(policy="priority", aging_interval=rng.choice([None, 3]))
    elif variant == "partial":
        opts.update(max_num_partial_prefills=3, long_prefill_token_threshold=rng.randint(4, 64))
    elif variant == "aligned" or (variant == "cache" and kv_policy != "paged"):
        opts.update(block_size=bs, align_chunks=True)
        budget = max(budget, bs)
    elif variant == "cache":
        opts.update(enable_prefix_caching=True)
        reqs = [Request(r.rid, r.prompt_len, r.max_new, lora=r.lora,
                        block_hashes=tuple(range(r.prompt_len // bs))) for r in reqs]
    largest = max(-(-(r.prompt_len + r.max_new) // bs) * bs for r in reqs)
    kv = rng.choice([largest, largest + rng.randint(0, largest), largest * 20])
    chk = InvariantChecker(Scheduler(token_budget=budget, max_seqs=max_seqs, kv_tokens=kv, **opts))
    arrive = sorted(rng.randint(0, 150) for _ in reqs)
    p_abort, p_stop = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.05])
    i = 0
    while i < len(reqs) or chk.has_unfinished():
        while i < len(reqs) and arrive[i] <= chk.scheduler.step:
            chk.add(reqs[i])
            i += 1
        if p_abort and i and rng.random() < p_abort:
            chk.abort(rng.choice(reqs[:i]).rid)
        plan = chk.schedule()
        chk.complete(plan, [r for r in plan.sampled_rids if rng.random() < p_stop])
        assert chk.scheduler.step < 200_000, "did not terminate"
    chk.check_final()
    assert all(r.rid not in chk.scheduler for r in reqs)
    return chk


def load_benchmark(name: str):  # type: ignore[no-untyped-def]
    """benchmarks/<name>.py loaded as a module (the scripts are not a package), registered in sys.modules
    under `<name>_bench` so that dataclasses can look their module up."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
