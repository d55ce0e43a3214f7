"""`stallfree simulate --autoscale MIN:MAX`: the flags, their checks, the autoscaled run's figures (the
replica count over time, GPU hours, cost, SLO attainment per window), the static fleet of MAX replicas
beside it, and the plot.

Imports allowed: the standard library, stallfree.flags and stallfree.sim; numpy and matplotlib lazily.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.sim.commands.common import CliError
from stallfree.sim.defaults import (
    DEFAULT_SCALE_DOWN_DELAY_S,
    DEFAULT_SCALE_INTERVAL_S,
    DEFAULT_WINDOW_S,
    SCALE_DECISION_LIMIT,
    WINDOW_LIMIT,
)

if TYPE_CHECKING:
    from stallfree.sim.run.autoscale import AutoscaleConfig, Fleet

# stallfree.sim.run.autoscale (the event loop's) is imported where --autoscale is checked or run, so that
# building the parser stays cheap.

__all__ = [
    "DEFAULT_POLICY",
    "add_flags",
    "check_flags",
    "fleet_figures",
    "group",
    "print_lines",
    "static_figures",
    "write_plot",
]

#: The default policy: Knative Serving's default concurrency target per replica
#: (container-concurrency-target-default: 100 requests in flight), which KServe's serverless mode uses.
DEFAULT_POLICY = "inflight:100"

#: The flags that apply to --autoscale alone, and their argparse dests.
_FLAGS = (("--scale-policy", "scale_policy"), ("--scale-interval", "scale_interval"),
          ("--scale-up-delay", "scale_up_delay"), ("--scale-down-delay", "scale_down_delay"),
          ("--window", "window"), ("--gpu-price", "gpu_price"))

_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "min": 60.0, "h": 3600.0}


def seconds(text: str, flag: str, positive: bool = False) -> float:
    """A duration of the autoscaling flags, s: a number with s, ms, min or h (bare = s).

    Raises:
        CliError: not a duration, negative, or 0 where `positive` (exit 2, naming the flag and value).
    """
    m = re.fullmatch(r"\s*([-+]?[0-9.eE+-]+)\s*(ms|s|min|h)?\s*", text)
    value = math.nan
    if m:
        try:
            value = float(m.group(1)) * _UNITS[m.group(2) or ""]
        except ValueError:
            value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        low = "> 0" if positive else ">= 0"
        raise CliError(f"{flag} {text}: must be a duration {low} (120, 120s, 2min; bare = s)", 2)
    return value


def add_flags(sim: Any) -> None:
    """The autoscaling flags of `simulate` (docs/cluster.md, "Autoscaling")."""
    a = sim.add_argument_group("autoscaling (docs/cluster.md, \"Autoscaling\")")
    a.add_argument(
        "--autoscale", metavar="MIN:MAX",
        help="instead of --replicas: start at MIN replicas (0: scale to zero, requests wait at the router) and "
        "let the autoscaler add up to MAX and remove down to MIN; MIN:MIN is the static run of --replicas MIN",
    )
    a.add_argument(
        "--scale-policy", metavar="POLICY",
        help="inflight:T (target requests in flight per replica) or queue:W[,kv:F] (target waiting requests "
        f"per serving replica, and KV usage fraction) (default {DEFAULT_POLICY}: Knative's concurrency target)",
    )
    a.add_argument("--scale-interval", metavar="T",
                   help=f"time between decisions (default {DEFAULT_SCALE_INTERVAL_S:g}s; bare = s)")
    a.add_argument(
        "--scale-up-delay", metavar="T",
        help="a new replica serves this long after the decision that adds it: weight load and warm-up "
        "(default: the replica's weight bytes over 1,000 MiB/s, an EBS gp3 volume's most; bare = s)",
    )
    a.add_argument(
        "--scale-down-delay", metavar="T",
        help="stabilisation window: the fleet shrinks only to the largest count asked for within it "
        f"(default {DEFAULT_SCALE_DOWN_DELAY_S:g}s, the Kubernetes HPA's; bare = s)",
    )
    a.add_argument("--window", metavar="T",
                   help=f"SLO attainment per window of arrivals of T (default {DEFAULT_WINDOW_S:g}s; bare = s)")
    a.add_argument("--gpu-price", metavar="NAME=USD",
                   help="the GPU's price, US dollars per GPU-hour (as plan's: h100-sxm=2.99): the cost of the run "
                   "and of the static fleet")


def check_flags(args: argparse.Namespace) -> None:
    """Refuse autoscaling flags without --autoscale, bad values and combinations not modelled, before
    anything runs; parse the values into args (autoscale_range, autoscale_policy, ...).

    Raises:
        CliError: exit 2, one line naming the flag and the value.
    """
    if args.autoscale is None:
        for flag, dest in _FLAGS:
            if getattr(args, dest) is not None:
                raise CliError(f"{flag} applies to --autoscale MIN:MAX: add it or drop {flag}", 2)
        return
    from stallfree.sim.run.autoscale import AutoscaleError, parse_autoscale, parse_policy

    try:
        args.autoscale_range = parse_autoscale(args.autoscale)
        args.autoscale_policy = parse_policy(args.scale_policy or DEFAULT_POLICY)
    except AutoscaleError as exc:
        raise CliError(str(exc), 2) from None
    args.autoscale_interval = (seconds(args.scale_interval, "--scale-interval", positive=True)
                               if args.scale_interval is not None else DEFAULT_SCALE_INTERVAL_S)
    args.autoscale_up = seconds(args.scale_up_delay, "--scale-up-delay") if args.scale_up_delay is not None else None
    args.autoscale_down = (seconds(args.scale_down_delay, "--scale-down-delay")
                           if args.scale_down_delay is not None else DEFAULT_SCALE_DOWN_DELAY_S)
    args.autoscale_window = seconds(args.window, "--window", positive=True) if args.window is not None \
        else DEFAULT_WINDOW_S
    if args.disaggregate is not None:
        raise CliError("--autoscale does not compose with --disaggregate in this version (each side would need "
                       "its own signal): drop one of them", 2)
    if args.replicas != 1:
        raise CliError("--autoscale MIN:MAX sets the replicas: drop --replicas", 2)
    for flag, asked in (("--compare", args.compare), ("--compare-caching", args.compare_caching),
                        ("--concurrency", args.concurrency is not None),
                        ("--synthetic sessions", args.synthetic == "sessions")):
        if asked:
            raise CliError(f"--autoscale replays one fleet on open-loop arrivals: drop {flag}", 2)
    if args.gpu_price is not None:
        from stallfree.sim.inputs.prices import PriceError, gpu_key, parse_gpu_prices

        try:
            prices = parse_gpu_prices(args.gpu_price)
            key = gpu_key(args.gpu)
        except PriceError as exc:
            raise CliError(str(exc), 2) from None
        if key not in prices:
            raise CliError(f"--gpu-price {args.gpu_price}: no price for the run's GPU, {args.gpu}", 2)
        args.autoscale_usd = prices[key].usd_per_hour
    else:
        args.autoscale_usd = None


def config(args: argparse.Namespace, setup: Any) -> tuple[AutoscaleConfig, str]:
    """The run's AutoscaleConfig, and where its scale-up delay comes from.

    Raises:
        CliError: no --scale-up-delay and the replica's weight bytes are unknown (exit 2).
    """
    from stallfree.sim.run.autoscale import AutoscaleConfig, AutoscaleError, default_up_delay

    lo, hi = args.autoscale_range
    up, source = args.autoscale_up, "--scale-up-delay"
    if up is None:
        hw = setup.hardware_options
        try:
            up, source = default_up_delay(hw.model, hw.gpu, hw.tp, hw.dtype)
        except ValueError as exc:
            raise CliError(f"--scale-up-delay: no default ({exc}): give one", 2) from None
    try:
        return AutoscaleConfig(lo, hi, args.autoscale_policy, args.autoscale_interval, up,
                               args.autoscale_down), source
    except AutoscaleError as exc:
        raise CliError(str(exc), 2) from None


def group(args: argparse.Namespace, setup: Any) -> tuple[Callable[..., Any] | None, list[Fleet], int]:
    """For simulate's cluster run: (the event loop's runner, the list its Fleet goes into, the replicas to
    build); (None, [], --replicas) without --autoscale."""
    if args.autoscale is None:
        return None, [], args.replicas
    from stallfree.sim.inputs.sessions import SessionWorkload

    if isinstance(setup.workload, SessionWorkload):
        raise CliError("--autoscale replays one fleet on open-loop arrivals: a session trace is not modelled "
                       "with it", 2)
    from stallfree.sim.run.autoscale import runner

    conf, source = config(args, setup)
    check_counts(args, setup.workload.arrivals)
    args.autoscale_config, args.autoscale_up_source = conf, source
    fleets: list[Fleet] = []
    return runner(conf, fleets), fleets, conf.max_replicas


def _at_least(x: float) -> str:
    """`x` rounded up to three significant digits, as %g writes it (a bound that the value shown meets)."""
    if x <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / step) * step:g}"


def _too_many(flag: str, text: str, count: int, what: str, limit: int, span: float, run: bool) -> CliError:
    """The refusal of a duration flag (`text` as typed) that makes `count` > `limit` of `what` over
    `span` s, the run's (`run`) or its arrivals': it says the smallest duration allowed for it (exit 2)."""
    whose = "run's" if run else "arrivals'"
    over = f"{span:,.2f}" if span >= 1 else f"{span:.3g}"
    return CliError(f"{flag} {text}: {count:,} {what} over the {whose} {over} s, more than "
                    f"the {limit:,} allowed: give {flag} {_at_least(span / limit)} or more"
                    + ("" if run else " (more still if the run outlasts its arrivals)"), 2)


def window_count(window: float, t0: float, end: float) -> int:
    """The attainment windows of `window` s from `t0` to `end`, s (at least one)."""
    return max(1, math.ceil((end - t0) / window))


def check_counts(args: argparse.Namespace, arrivals: Any) -> None:
    """Refuse, before the run, a --scale-interval that makes more than SCALE_DECISION_LIMIT decisions or
    a --window that makes more than WINDOW_LIMIT windows over the arrivals' span (the first arrival to the
    last; the run itself lasts longer, so these are at least the run's counts).

    Raises:
        CliError: exit 2, naming the flag, the value and the smallest allowed for these arrivals.
    """
    if len(arrivals) < 2:
        return
    t0, last = float(arrivals[0]), float(arrivals[-1])
    span = last - t0
    lo, hi = args.autoscale_range
    decisions = math.floor(span / args.autoscale_interval)
    if decisions > SCALE_DECISION_LIMIT and lo != hi:  # MIN == MAX decides nothing
        raise _too_many("--scale-interval", _typed(args.scale_interval, DEFAULT_SCALE_INTERVAL_S), decisions,
                        "scaling decisions", SCALE_DECISION_LIMIT, span, run=False)
    windows = window_count(args.autoscale_window, t0, last)
    if windows > WINDOW_LIMIT:
        raise _too_many("--window", _typed(args.window, DEFAULT_WINDOW_S), windows, "SLO attainment windows",
                        WINDOW_LIMIT, span, run=False)


def _typed(text: str | None, default: float) -> str:
    """A duration flag's value as typed, or its default, said to be one."""
    return text if text is not None else f"{default:g} (the default)"


def gpus_per_replica(setup: Any) -> int:
    """GPUs of one replica: tp x dp_attention."""
    hw = setup.hardware_options
    return int(hw.tp) * int(getattr(hw, "dp_attention", 1) or 1)


def _attainment_windows(res: Any, slo_ttft: float | None, slo_tpot: float | None, window: float,
                        t0: float, end: float, window_text: str | None = None) -> list[dict[str, Any]]:
    """Per window of arrivals [t0 + k w, t0 + (k + 1) w): requests arriving, offered req/s, and the share
    of them served within both SLOs (a request not served misses; None without an SLO or a request).
    `window_text`: --window as typed (None: `window`), for the refusal.

    Raises:
        CliError: more than WINDOW_LIMIT windows (exit 2).
    """
    import numpy as np

    from stallfree.sim.outputs.report import latency_arrays, slo_met

    arrival = np.asarray(res.arrival, dtype=np.float64)
    good = np.zeros(len(arrival), dtype=bool)
    slo = slo_ttft is not None or slo_tpot is not None
    if slo:
        lat = latency_arrays(res)
        good[lat["rids"]] = slo_met(lat, slo_ttft, slo_tpot)
    last = max(end, float(arrival.max()) if len(arrival) else t0)
    count = window_count(window, t0, last)
    if count > WINDOW_LIMIT:
        # check_counts refused this over the arrivals; the run went on past them (a backlog draining).
        raise _too_many("--window", window_text or f"{window:g}", count, "SLO attainment windows", WINDOW_LIMIT,
                        last - t0, run=True)
    k = np.floor((arrival - t0) / window).astype(np.int64)
    n = np.bincount(k, minlength=count)
    g = np.bincount(k, weights=good.astype(np.float64), minlength=count)
    return [{"t_s": t0 + i * window, "requests": int(n[i]), "offered_req_s": float(n[i]) / window,
             "slo_attainment": (float(g[i]) / float(n[i])) if slo and n[i] else None} for i in range(len(n))]


def fleet_figures(args: argparse.Namespace, setup: Any, summary: dict[str, Any], cluster: Any, fleet: Fleet) -> None:
    """Add the autoscaled run's keys to its summary: autoscale (the settings), replicas_timeline
    ([[t_s, serving, loading], ...]; draining replicas count as serving), replicas_peak, gpu_hours,
    gpus_per_replica, cost_usd (with --gpu-price) and slo_attainment_by_window."""
    conf: AutoscaleConfig = args.autoscale_config
    gpus = gpus_per_replica(setup)
    gpu_hours = fleet.replica_s * gpus / 3600.0
    t0 = fleet.timeline[0][0] if fleet.timeline else 0.0
    summary["autoscale"] = conf.record() | {"scale_up_delay_source": args.autoscale_up_source,
                                            "window_s": args.autoscale_window}
    summary["replicas_timeline"] = [[t, int(s), int(ld)] for t, s, ld in fleet.timeline]
    summary["replicas_peak"] = max((int(s) + int(ld) for _, s, ld in fleet.timeline), default=0)
    summary["gpus_per_replica"] = gpus
    summary["gpu_hours"] = gpu_hours
    summary["usd_per_gpu_hour"] = args.autoscale_usd
    summary["cost_usd"] = gpu_hours * args.autoscale_usd if args.autoscale_usd is not None else None
    summary["slo_attainment_by_window"] = _attainment_windows(
        cluster.merged, args.slo_ttft, args.slo_tpot, args.autoscale_window, t0, fleet.end_s,
        _typed(args.window, DEFAULT_WINDOW_S))


def static_figures(args: argparse.Namespace, setup: Any, summary: dict[str, Any], cluster: Any,
                   run_static: Callable[[], tuple[dict[str, Any], Any]]) -> None:
    """Add `static` (the same trace on MAX replicas: replicas, gpu_hours, slo_attainment, cost_usd,
    sim_wall_s), gpu_hours_saved and slo_attainment_lost to the autoscaled run's summary. With MIN == MAX
    the run is the static one and is not run twice. `run_static` runs the static fleet:
    (its summary, its ClusterResult)."""
    conf: AutoscaleConfig = args.autoscale_config
    if conf.static:
        s, c = summary, cluster
    else:
        s, c = run_static()
    ends = [float(max(r.step_end)) for r in c.replicas if len(r.step_end)]
    start = float(min(c.merged.arrival)) if len(c.merged.arrival) else 0.0
    span = max(0.0, max(ends, default=start) - start)
    hours = conf.max_replicas * span * gpus_per_replica(setup) / 3600.0
    usd = args.autoscale_usd
    summary["static"] = {"replicas": conf.max_replicas, "gpu_hours": hours, "slo_attainment": s.get("slo_attainment"),
                         "cost_usd": hours * usd if usd is not None else None, "sim_wall_s": c.wall_s,
                         "p99_ttft_ms": s.get("p99_ttft_ms")}
    summary["gpu_hours_saved"] = hours - summary["gpu_hours"]
    a, b = summary.get("slo_attainment"), s.get("slo_attainment")
    summary["slo_attainment_lost"] = b - a if a is not None and b is not None else None


def print_lines(summary: dict[str, Any], file: Any = None) -> None:
    """The autoscaled run's lines under its table."""
    out = file or sys.stdout
    a, st = summary["autoscale"], summary["static"]
    usd = summary.get("cost_usd")
    print(f"autoscale {a['min']}:{a['max']}, {a['policy']}, a decision every {a['scale_interval_s']:g} s, "
          f"scale-up delay {a['scale_up_delay_s']:,.1f} s ({a['scale_up_delay_source']}), scale-down delay "
          f"{a['scale_down_delay_s']:g} s: peak {summary['replicas_peak']} replicas; "
          f"{summary['gpu_hours']:,.2f} GPU hours" + (f" (${usd:,.2f})" if usd is not None else ""), file=out)
    att, satt = summary.get("slo_attainment"), st.get("slo_attainment")
    line = (f"static fleet of {st['replicas']} replicas: {st['gpu_hours']:,.2f} GPU hours"
            + (f" (${st['cost_usd']:,.2f})" if st.get("cost_usd") is not None else ""))
    if st["gpu_hours"] > 0:
        saved = summary["gpu_hours_saved"]
        # More hours than the static fleet: the autoscaled run lasts longer (a queue left by slow scale-ups).
        line += (f"; autoscaling saves {saved:,.2f} ({saved / st['gpu_hours']:.0%})" if saved >= 0 else
                 f"; autoscaling costs {-saved:,.2f} GPU hours more ({-saved / st['gpu_hours']:.0%} more: its "
                 "run lasts longer)")
    if att is not None and satt is not None:
        points = (satt - att) * 100
        line += (f"; SLO attainment {att:.2%} against {satt:.2%} ("
                 + (f"{points:.2f} points lost)" if points >= 0 else f"{-points:.2f} points gained)"))
    else:
        line += "; SLO attainment: give --slo-ttft and/or --slo-tpot"
    print(line, file=out)


def write_plot(out: Path, summary: dict[str, Any]) -> str:
    """autoscale.png in `out`: the replicas serving and loading over time beside the offered rate per
    window, and the SLO attainment per window; returns the file's name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["replicas_timeline"]
    wins = summary["slo_attainment_by_window"]
    end = max(rows[-1][0], wins[-1]["t_s"] + summary["autoscale"]["window_s"]) if wins else rows[-1][0]
    t = [r[0] / 3600 for r in rows] + [end / 3600]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
    ax.step(t, [r[1] for r in rows] + [rows[-1][1]], where="post", label="serving")
    ax.step(t, [r[1] + r[2] for r in rows] + [rows[-1][1] + rows[-1][2]], where="post", ls="--",
            label="serving + loading")
    ax.axhline(summary["static"]["replicas"], color="grey", lw=0.8, ls=":", label="static fleet")
    ax.set_ylabel("replicas")
    rx = ax.twinx()
    rx.plot([w["t_s"] / 3600 for w in wins], [w["offered_req_s"] for w in wins], color="tab:red", lw=0.9,
            label="offered rate")
    rx.set_ylabel("offered requests/s", color="tab:red")
    ax.legend(loc="upper left", fontsize=8)
    att = [(w["t_s"] / 3600, w["slo_attainment"]) for w in wins if w["slo_attainment"] is not None]
    if att:
        bx.plot([a for a, _ in att], [b * 100 for _, b in att], marker=".", lw=0.8)
    bx.set_ylabel("SLO attainment %")
    bx.set_xlabel("hours")
    a = summary["autoscale"]
    ax.set_title(f"autoscale {a['min']}:{a['max']} {a['policy']}, scale-up delay {a['scale_up_delay_s']:,.0f} s: "
                 f"{summary['gpu_hours']:,.1f} GPU h against {summary['static']['gpu_hours']:,.1f} static",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "autoscale.png", dpi=110)
    plt.close(fig)
    return "autoscale.png"
