"""Reports of simulations: the summary (vLLM's serving-benchmark keys plus scheduler figures),
per-request and per-step records, terminal tables and JSON/CSV files.

Imports allowed: the standard library, stallfree.core and stallfree.sim; numpy and rich only inside
functions (lazily), so that the event loop never loads them.

The summary follows the definitions of stallfree.core.metrics exactly (the test suite checks it
against stallfree.core.metrics.summarize); it is computed with numpy because a whole trace has
millions of inter-token gaps.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from stallfree.core.metrics import DEFAULT_PERCENTILES, throughput_figures
from stallfree.sim.outputs import itl as _itl
from stallfree.sim.outputs.buckets import bucket_stats
from stallfree.sim.outputs.itl import itl_stats, pairwise_sum, step_durations, step_numbers, step_starts
from stallfree.sim.run.result import SimResult
from stallfree.sim.run.session_run import session_summary

__all__ = [
    "finished_rids",
    "latency_arrays",
    "slo_met",
    "summarize_result",
]


def finished_rids(res: SimResult) -> Any:
    """The requests of `res` that finished with a first token, in rid order (latency_arrays' "rids"): a
    numpy int64 array; a cluster replica's own requests alone (SimResult.owner)."""
    import numpy as np

    first, fin = step_numbers(res.first_step), step_numbers(res.finish_step)
    mine = (fin >= 0) & (first >= 0)
    if res.owner is not None:  # a cluster's replica: its requests alone (SimResult.owner)
        mine &= np.frombuffer(res.owner, dtype=np.int32) == res.replica if isinstance(res.owner, array) else (
            np.asarray(res.owner) == res.replica)
    return np.flatnonzero(mine)


def latency_arrays(res: SimResult, itl: bool = True) -> dict[str, Any]:
    """Per-request TTFT, TPOT, E2E, queueing delay (s) and all inter-token gaps, as numpy arrays.

    `itl=False` leaves out "itl" (every inter-token gap, one float per token: the one array that grows
    with the tokens rather than the requests); summarize_result takes the gaps' figures from itl_stats,
    which never holds them all.

    Returns:
        dict with "rids" [n_done], "ttft" [n_done], "tpot" [n_multi] (requests with >= 2 tokens),
        "tpot_rids" [n_multi], "e2e" [n_done], "queue" [n_done], "itl" [total tokens - n_done],
        "tokens" [n_done] (tokens emitted), all in seconds except the counts. TTFT and E2E include the
        engine profile's front-end time when the result's config has ``frontend_s`` (s; set by
        simulate when the cost model is a stallfree.sim.inputs.engine_profile.ProfiledCostModel); the queueing
        delay, TPOT and the gaps are the engine's.
    """
    import numpy as np

    end = np.frombuffer(res.step_end, dtype=np.float64)
    dec = np.asarray(res.step_decodes)
    # Step numbers in their own integer type (a cluster's are C ints): indices only, never summed.
    first, fin, adm = (step_numbers(x) for x in (res.first_step, res.finish_step, res.admit_step))
    arrival = np.asarray(res.arrival, dtype=np.float64)
    done = finished_rids(res)
    irregular = set(res.skips) | set(res.segments)
    tokens = np.asarray(res.target, dtype=np.int64)[done]  # not a Python int per request
    out: dict[str, Any] = {"rids": done, "tokens": tokens}
    a, b = first[done], fin[done]
    # An engine profile's front end (config frontend_s, s): the client's TTFT and E2E include it.
    frontend = float(res.config.get("frontend_s", 0.0))
    out["ttft"] = end[a] - arrival[done] + frontend
    out["e2e"] = end[b] - arrival[done] + frontend
    out["queue"] = step_starts(res, adm[done]) - arrival[done]
    multi = tokens > 1
    out["tpot"] = (end[b][multi] - end[a][multi]) / (tokens[multi] - 1)
    out["tpot_rids"] = done[multi]
    if not itl:
        return out
    # Inter-token gaps of the regular requests, vectorised: the token steps of a request are its
    # first-token step a, then every step in (a, b] that had decodes.
    reg = np.ones(len(done), dtype=bool)
    if irregular:
        reg = np.asarray([r not in irregular for r in done.tolist()], dtype=bool)
    ra, rb = a[reg], b[reg]
    lengths = rb - ra
    total = int(lengths.sum())
    gaps = [np.empty(0)]
    if total:
        owner = np.repeat(np.arange(len(ra)), lengths)
        offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        steps = ra[owner] + offsets + 1
        keep = dec[steps] > 0
        steps, owner = steps[keep], owner[keep]
        prev = np.empty_like(steps)
        prev[1:] = steps[:-1]
        new_owner = np.ones(len(steps), dtype=bool)
        new_owner[1:] = owner[1:] != owner[:-1]
        prev[new_owner] = ra[owner[new_owner]]
        gaps.append(end[steps] - end[prev])
        ticks = np.cumsum(dec > 0)  # SimResult.step_ticks, counted here
        assert int(ticks[rb].sum() - ticks[ra].sum()) == len(steps)
    for r in sorted(irregular):
        if res.finish_step[r] >= 0:
            gaps.append(np.diff(np.asarray(res.token_times(r))))
    out["itl"] = np.concatenate(gaps)
    return out


def _stats(name: str, values: Any, percentiles: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [
        f"p{q:g}_{name}_ms" for q in percentiles
    ]
    if len(values) == 0:
        return dict.fromkeys(keys, None)
    ms = values * 1e3
    out: dict[str, float | None] = {
        keys[0]: float(np.mean(ms)),
        keys[1]: float(np.median(ms)),
        keys[2]: float(np.std(ms)),
    }
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = float(np.percentile(ms, q))
    return out


def _throughputs(
    res: SimResult, lat: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, Any]:
    """The totals and rates of a run that completed requests, for summarize_result: completed,
    total_{input,output}_tokens, duration_s (first arrival to last finish, s), request_, output_ and
    total_token_throughput (per s), request_goodput and slo_attainment (None without an SLO), and a
    closed loop's achieved_request_rate. `lat`: latency_arrays(res)."""
    import numpy as np

    done = lat["rids"]
    end = np.frombuffer(res.step_end, dtype=np.float64)
    arrival = np.asarray(res.arrival, dtype=np.float64)
    fin = step_numbers(res.finish_step)[done]
    duration = float(end[fin].max() - arrival.min())
    n_out = int(lat["tokens"].sum())
    n_in = int(np.asarray(res.prompt_len, dtype=np.int64)[done].sum())  # exact: integers
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.inf)
    out: dict[str, Any] = throughput_figures(len(done), n_in, n_out, duration)
    out["slo_attainment"] = None
    if "concurrency" in res.config:
        # Closed loop: the rate the clients reached, requests sent (refused ones too) per second.
        out["achieved_request_rate"] = rate(res.num_requests)
    if slo_ttft is not None or slo_tpot is not None:
        good = slo_met(lat, slo_ttft, slo_tpot)
        out["request_goodput"] = rate(int(good.sum()))
        out["slo_attainment"] = float(good.mean())
    return out


def summarize_result(
    res: SimResult,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Summarize a simulation: the keys of stallfree.core.metrics.summarize plus the scheduler's.

    Args:
        res: the simulation.
        slo_ttft: TTFT objective for goodput, s (None: none).
        slo_tpot: TPOT objective for goodput, s (None: none).
        percentiles: which percentiles to report (default 50, 90, 99).

    Returns:
        A flat dict: label, workload, num_requests, rejected, rejected_by_reason (a dict: kind ->
        count, kinds "context_length" and "kv_capacity"), completed, total_input_tokens,
        total_output_tokens, duration_s, request_throughput, output_throughput,
        total_token_throughput, request_goodput, slo_attainment, {mean,median,std,pXX}_{ttft,
        tpot,itl,e2el,queue}_ms, num_steps, mean_tokens_per_step, budget_utilization (mean tokens
        per step / token budget), queued_fraction (share of steps after which requests waited),
        mean_kv_utilization and max_kv_utilization (reserved / total KV, time-weighted mean and
        maximum), mean_running_decodes, sim_wall_s, by_prompt_len (stallfree.sim.outputs.buckets.bucket_stats:
        per prompt-length bucket, requests and the median and p99 TTFT, TPOT and E2E, ms); plus the
        scheduler config. A session run (stallfree.sim.inputs.sessions) adds ttft_by_turn and sessions
        (stallfree.sim.inputs.sessions.session_summary). A closed-loop run
        (config concurrency, think_time_s) adds achieved_request_rate: requests sent (refused ones
        included) / duration_s, requests/s.

        A run that kept no records (res.tally: stallfree.sim.run.tally) gives the same keys from its
        tally, its percentiles within the tally's relative accuracy (percentile_relative_error, a key of
        its own), its means and sums to about 1e-12.

    Raises:
        ValueError: a run without records summarized against other SLOs than the ones it counted.
    """
    pcts = tuple(percentiles)
    if res.tally is not None:
        return _summarize_tally(res, slo_ttft, slo_tpot, pcts)
    # The gaps' figures first, before the latency arrays exist: their pieces and those arrays are the
    # summary's two largest holdings, so they are never held at once.
    done = finished_rids(res)
    itl_figures = itl_stats(res, done, pcts) if len(done) else {}
    del done
    lat = latency_arrays(res, itl=False)
    done = lat["rids"]
    n_done = len(done)
    out: dict[str, Any] = {"label": res.label, "workload": res.workload, **res.config}
    out["num_requests"] = res.num_requests
    out["rejected"] = len(res.rejected)
    out["rejected_by_reason"] = res.rejected_by_reason
    if n_done == 0:
        out["completed"] = 0
        return out
    out.update(_throughputs(res, lat, slo_ttft, slo_tpot))
    for name, key in (
        ("ttft", "ttft"),
        ("tpot", "tpot"),
        ("itl", "itl"),
        ("e2el", "e2e"),
        ("queue", "queue"),
    ):
        # The gaps' figures are numpy's on every gap, computed without holding them (outputs/itl.py).
        out.update(itl_figures if key == "itl" else _stats(name, lat[key], pcts))
    out["by_prompt_len"] = bucket_stats(lat, res.prompt_len)
    if res.tenant is not None:
        out["by_tenant"] = tenant_stats(res, lat)
    out.update(_step_figures(res))
    if res.session_keys is not None:
        out.update(session_summary(res, float(res.config.get("frontend_s", 0.0))))
        # As under closed-loop load, the replica sets the request rate: turns sent / duration.
        sent = res.num_requests - res.rejected_by_reason.get("session_ended", 0)
        out["achieved_request_rate"] = sent / out["duration_s"] if out.get("duration_s") else None
    if res.lora is not None:
        from stallfree.sim.run.lora import lora_summary

        out["lora"] = lora_summary(res, lat)
    return out


def tenant_stats(res: SimResult, lat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per tenant (res.tenant), sorted by name: num_requests, completed, shed (finished by a queue time
    limit, reason "timeout": never served, so in no latency figure), rejected, output_tokens (of the
    completed), and the median and p99 of TTFT and TPOT in ms (None without a value).

    Args:
        res: a simulation whose workload names tenants.
        lat: latency_arrays(res).
    """
    import numpy as np

    assert res.tenant is not None
    tenant = res.tenant
    rejected = {r for r, _ in res.rejected}
    out: dict[str, dict[str, Any]] = {}
    names = sorted(set(tenant))
    done, ttft = lat["rids"].tolist(), lat["ttft"]
    tpot_rids, tpot = lat["tpot_rids"].tolist(), lat["tpot"]
    for name in names:
        mine = [i for i, r in enumerate(done) if tenant[r] == name]
        mine_tpot = [i for i, r in enumerate(tpot_rids) if tenant[r] == name]
        row: dict[str, Any] = {
            "num_requests": sum(1 for t in tenant if t == name),
            "completed": len(mine),
            "shed": sum(1 for r, t in enumerate(tenant)
                        if t == name and res.finish_reason[r] == "timeout" and res.owns(r)),
            "rejected": sum(1 for r in rejected if tenant[r] == name),
            "output_tokens": int(sum(res.target[done[i]] for i in mine)),
        }
        for key, values in (("ttft", ttft[mine] if mine else None), ("tpot", tpot[mine_tpot] if mine_tpot else None)):
            row[f"median_{key}_ms"] = float(np.median(values)) * 1e3 if values is not None else None
            row[f"p99_{key}_ms"] = float(np.percentile(values, 99)) * 1e3 if values is not None else None
        out[name] = row
    return out


def slo_met(lat: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None) -> Any:
    """Per finished request (latency_arrays order), whether it met both SLOs (s; None: no objective):
    a numpy bool array [n_done]. A request of one token has no TPOT and meets any TPOT objective."""
    import numpy as np

    done = lat["rids"]
    good = np.ones(len(done), dtype=bool)
    if slo_ttft is not None:
        good &= lat["ttft"] <= slo_ttft
    if slo_tpot is not None:
        tpot_ok = np.ones(len(done), dtype=bool)
        tpot_ok[np.searchsorted(done, lat["tpot_rids"])] = lat["tpot"] <= slo_tpot
        good &= tpot_ok
    return good


def _step_figures(res: SimResult) -> dict[str, Any]:
    """The scheduler's figures of summarize_result, from the step arrays and the result's counters.

    numpy's figures on whole arrays (tokens.mean(), (kv * dur).sum(), ...), bit for bit, in pieces of at
    most itl.CHUNK steps: the sums of floats by itl.pairwise_sum (numpy's own order of additions), those
    of integers exactly (as numpy's float64 sums of them are, below 2**53), so that no array as long as
    the run's steps is made.
    """
    import numpy as np

    n = res.num_steps
    piece = step_durations(res)
    tokens = np.asarray(res.step_tokens)
    kv = np.asarray(res.step_kv_used)
    waiting = np.asarray(res.step_waiting)
    decodes = np.asarray(res.step_decodes)
    busy = pairwise_sum(n, piece)
    token_sum = queued = 0
    kv_max = None
    chunk = _itl.CHUNK
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        token_sum += int(tokens[lo:hi].sum(dtype=np.int64))
        queued += int(np.count_nonzero(waiting[lo:hi]))
        top = int(kv[lo:hi].max())
        kv_max = top if kv_max is None or top > kv_max else kv_max
    kv_dur = pairwise_sum(n, lambda lo, hi: kv[lo:hi] * piece(lo, hi))
    dec_dur = pairwise_sum(n, lambda lo, hi: decodes[lo:hi] * piece(lo, hi))
    return _step_keys(res, n, token_sum, queued, kv_max, busy, kv_dur, dec_dur)


def _step_keys(res: SimResult, n: int, token_sum: int, queued: int, kv_max: int | None, busy: float,
               kv_dur: float, dec_dur: float) -> dict[str, Any]:
    """_step_figures' keys from the step sums (n steps; tokens; steps after which requests waited; the most
    KV reserved, tokens; the sums over steps of duration, KV x duration and decodes x duration, s) and the
    result's counters."""
    # numpy's means of the integer arrays: their float64 sums (exact) over the count.
    mean_tokens = float(token_sum) / n if n else math.nan
    budget = res.config.get("token_budget")
    return dict(
        num_steps=n,
        mean_tokens_per_step=mean_tokens,
        budget_utilization=mean_tokens / budget if budget else None,
        queued_fraction=float(queued) / n if n else math.nan,
        mean_kv_utilization=kv_dur / busy / res.kv_total if res.kv_total and busy else None,
        max_kv_utilization=kv_max / res.kv_total if res.kv_total and kv_max is not None else None,
        mean_running_decodes=dec_dur / busy if busy else 0.0,
        num_preemptions=res.num_preemptions,
        num_recomputed_tokens=res.num_recomputed_tokens,
        prefix_cache_hit_rate=res.prefix_cache_hit_rate,
        prefix_cache_hit_rate_bound=res.prefix_cache_hit_rate_bound,
        prefix_cache_evictions=res.prefix_cache_evictions,
        prefix_cache_hit_rate_first_admission=res.prefix_cache_hit_rate_first_admission,
        kv_tier=res.kv_tier,
        sim_wall_s=res.wall_s,
    )


def _summarize_tally(res: SimResult, slo_ttft: float | None, slo_tpot: float | None,
                     pcts: tuple[float, ...]) -> dict[str, Any]:
    """summarize_result of a run that kept no records, from its tally (stallfree.sim.run.tally.RunTally)."""
    from stallfree.sim.outputs.buckets import PROMPT_BUCKETS
    from stallfree.sim.run.tally import ALPHA

    t = res.tally
    if (slo_ttft, slo_tpot) != (t.slo_ttft, t.slo_tpot):
        raise ValueError(f"a run without records counted its goodput against slo_ttft={t.slo_ttft!r}, "
                         f"slo_tpot={t.slo_tpot!r}: it cannot be summarized against slo_ttft={slo_ttft!r}, "
                         f"slo_tpot={slo_tpot!r}")
    t.flush()
    out: dict[str, Any] = {"label": res.label, "workload": res.workload, **res.config}
    out["num_requests"] = res.num_requests
    out["rejected"] = len(res.rejected)
    out["rejected_by_reason"] = res.rejected_by_reason
    if t.completed == 0:
        out["completed"] = 0
        return out
    duration = t.last_finish - min(res.arrival)
    out.update(throughput_figures(t.completed, t.input_tokens, t.output_tokens, duration))
    out["slo_attainment"] = None
    if slo_ttft is not None or slo_tpot is not None:
        out["request_goodput"] = t.good / duration if duration > 0 else math.inf
        out["slo_attainment"] = t.good / t.completed
    for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e"), ("queue", "queue")):
        if key == "itl":
            sketch, moments = t.itl, t.itl_moments
        else:
            sketch, moments = t.figures[key].sketch, t.figures[key].moments
        out.update(_sketch_stats(name, sketch, moments, pcts))
    buckets: dict[str, dict[str, Any]] = {}
    for bucket, _, _ in PROMPT_BUCKETS:
        if bucket not in t.buckets:
            continue
        row: dict[str, Any] = {"requests": t.bucket_requests[bucket]}
        for key, label in (("ttft", "ttft"), ("tpot", "tpot"), ("e2e", "e2el")):
            sketch = t.buckets[bucket][key].sketch
            median, p99 = sketch.percentiles((50, 99)) if sketch.n else (None, None)
            row[f"median_{label}_ms"] = median * 1e3 if median is not None else None
            row[f"p99_{label}_ms"] = p99 * 1e3 if p99 is not None else None
        buckets[bucket] = row
    out["by_prompt_len"] = buckets
    out.update(_step_keys(res, t.num_steps, t.token_sum, t.queued_steps, t.kv_max, t.busy_s, t.kv_s, t.decodes_s))
    out["percentile_relative_error"] = ALPHA
    return out


def _sketch_stats(name: str, sketch: Any, moments: Any, percentiles: Sequence[float]) -> dict[str, float | None]:
    """_stats' keys (ms) from a sketch (the median and percentiles) and moments (the mean and std), in s."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{q:g}_{name}_ms" for q in percentiles]
    if moments.n <= 0:
        return dict.fromkeys(keys, None)
    values = sketch.percentiles((50, *percentiles))
    out: dict[str, float | None] = {keys[0]: moments.mean * 1e3, keys[1]: values[0] * 1e3, keys[2]: moments.std * 1e3}
    for q, v in zip(percentiles, values[1:], strict=True):
        out[f"p{q:g}_{name}_ms"] = v * 1e3
    return out


def served_share(summary: dict[str, Any]) -> float:
    """The share of a run's requests that the replicas could serve, 0..1: all but those rejected at
    add() (longer than the context, or a reservation that can never fit the KV). A run's load is judged
    by the rate of these: a request that can never fit adds no work, and more replicas would not serve it.
    A session's turns never sent (rejected as "session_ended", once an earlier turn of theirs was refused)
    count on neither side: a session run's rate is of the turns sent (achieved_request_rate), so the share
    is of those. 1.0 for a summary without requests."""
    unsent = (summary.get("rejected_by_reason") or {}).get("session_ended", 0)
    n = (summary.get("num_requests") or 0) - unsent
    return (n - ((summary.get("rejected") or 0) - unsent)) / n if n > 0 else 1.0

