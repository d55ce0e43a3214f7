"""Autoscaling in the event loop: a fleet of replicas between MIN and MAX whose size an autoscaler
changes as the load changes, with replicas that take time to arrive and leave only when drained.

Imports allowed: the standard library, stallfree.costmodel and stallfree.sim (loop, load, replica,
simulator, result).

The model (docs/cluster.md, "Autoscaling"):
  - MAX replica slots are built up front; MIN of them serve from the first arrival. A slot is off,
    loading, serving or draining. Routers see the serving replicas alone (in index order).
  - Every `interval_s` from the first arrival the autoscaler reads its signal and decides
    (a CALLBACK event of the loop, so it runs after the steps ending at that instant and before the
    arrivals of that instant). The signal:
      inflight:T  desired = ceil(requests in flight / T): the requests routed and not finished on
                  every replica, plus those waiting at the router for a replica.
      queue:W[,kv:F]  desired = ceil(serving x max(mean waiting per serving replica / W,
                  mean KV usage of the serving replicas / F)) (the Kubernetes HPA rule,
                  desired = ceil(current x metric / target)), the figures the server exports as
                  `stallfree_num_requests_waiting` and `stallfree_kv_cache_usage_ratio`; with no replica
                  serving, 1 if a request waits at the router, else 0.
    Loading replicas count as capacity: a decision adds desired - (serving + loading), never again
    the replicas already on their way. A run makes at most SCALE_DECISION_LIMIT decisions: with work
    left after them it stops with an AutoscaleError (the interval is too short for the run).
  - Scaling up acts at once: at most max(MAX_ADDED_MIN, serving + loading) replicas are added per
    decision (the Kubernetes HPA's default scale-up policy: 4 pods or 100% of the current ones per
    period, whichever is more). A replica added at t serves from t + up_delay_s (weights loaded,
    warmed up).
  - Scaling down is stabilised: the target is the largest desired count of the decisions within the
    last down_delay_s (the HPA's downscale stabilisation window, default 300 s). Loading replicas are
    cancelled first (the latest first), then serving replicas with the fewest requests in flight
    (then the highest index) drain: they take no new request and leave when their last request ends.
  - With MIN == MAX nothing can change: no decision is made and the run is the static run of MAX
    replicas, figure for figure.
  - Requests that find no serving replica (MIN = 0, or scaled to zero) wait at the router and are
    routed, in arrival order, when one starts serving; their TTFT counts the wait.

Not modelled: a slot brought back keeps the prefix cache it held when it last drained (a real
replica restarts cold); a cancelled loading replica's GPUs are counted until the cancel.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.core.errors import StallfreeError
from stallfree.sim.defaults import (
    DEFAULT_SCALE_DOWN_DELAY_S,
    DEFAULT_SCALE_INTERVAL_S,
    DEFAULT_WINDOW_S,
    REPLICA_LIMIT,
    SCALE_DECISION_LIMIT,
)
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, PassGate, Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.simulator import request_maker

__all__ = [
    "DEFAULT_SCALE_DOWN_DELAY_S",
    "DEFAULT_SCALE_INTERVAL_S",
    "DEFAULT_WINDOW_S",
    "LOAD_BANDWIDTH_BYTES_PER_S",
    "MAX_ADDED_MIN",
    "AutoscaleConfig",
    "AutoscaleError",
    "Fleet",
    "ScalePolicy",
    "default_up_delay",
    "parse_autoscale",
    "parse_policy",
]

#: Weight load bandwidth of the default scale-up delay, bytes/s: the most an AWS EBS gp3 volume may be
#: provisioned to read (1,000 MiB/s, the EC2 CreateVolume API's throughput limit for gp3), a model
#: stored on a network block volume.
LOAD_BANDWIDTH_BYTES_PER_S = 1000 * 2**20
#: Replicas a decision may always add (the HPA's default scale-up policy: 4 pods or 100% per period).
MAX_ADDED_MIN = 4

OFF, LOADING, SERVING, DRAINING = 0, 1, 2, 3


class AutoscaleError(StallfreeError, ValueError):
    """An autoscaling option out of range; the message names the flag and the value (commands exit 2)."""


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """The autoscaler's signal and target.

    Attributes:
        kind: "inflight" (target requests in flight per replica) or "queue" (target waiting requests
            per serving replica, and optionally a KV usage fraction).
        target: T (inflight) or W (queue), > 0.
        kv: F, the target KV usage fraction in (0, 1], or None (queue only).
    """

    kind: str
    target: float
    kv: float | None = None

    def __str__(self) -> str:
        text = f"{self.kind}:{self.target:g}"
        return text + (f",kv:{self.kv:g}" if self.kv is not None else "")


def parse_autoscale(text: str) -> tuple[int, int]:
    """Parse `--autoscale MIN:MAX` into (MIN, MAX): integers with 0 <= MIN <= MAX and 1 <= MAX <=
    REPLICA_LIMIT (MIN = 0 scales to zero).

    Raises:
        AutoscaleError: not two integers, MIN > MAX, MIN < 0, MAX < 1 or MAX > REPLICA_LIMIT (the message
            names the flag).
    """
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        lo, hi = int(parts[0]), int(parts[1])
    except ValueError:
        raise AutoscaleError(f"--autoscale {text}: expected MIN:MAX, two integers (e.g. 1:8)") from None
    if lo < 0:
        raise AutoscaleError(f"--autoscale {text}: MIN must be >= 0 (0 scales to zero)")
    if hi < 1:
        raise AutoscaleError(f"--autoscale {text}: MAX must be >= 1")
    if lo > hi:
        raise AutoscaleError(f"--autoscale {text}: MIN {lo} is more than MAX {hi}")
    if hi > REPLICA_LIMIT:
        raise AutoscaleError(f"--autoscale {text}: MAX must be <= {REPLICA_LIMIT:,} replicas (every slot is built "
                             "up front)")
    return lo, hi


def parse_policy(text: str) -> ScalePolicy:
    """Parse `--scale-policy`: "inflight:T" or "queue:W[,kv:F]" (T, W > 0; 0 < F <= 1).

    Raises:
        AutoscaleError: another shape, or a target out of range (the message names the flag and value).
    """
    def number(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise AutoscaleError(f"--scale-policy {text}: {s!r} is not a number") from None
        if not (math.isfinite(v) and v > 0):
            raise AutoscaleError(f"--scale-policy {text}: the target must be a number > 0, got {s}")
        return v

    kind, _, rest = text.partition(":")
    if kind == "inflight" and rest and "," not in rest:
        return ScalePolicy("inflight", number(rest))
    if kind == "queue" and rest:
        head, _, kv = rest.partition(",")
        w = number(head)
        if not kv:
            return ScalePolicy("queue", w)
        name, _, f = kv.partition(":")
        if name == "kv" and f:
            fv = number(f)
            if fv > 1:
                raise AutoscaleError(f"--scale-policy {text}: the KV target is a fraction in (0, 1], got {f}")
            return ScalePolicy("queue", w, fv)
    raise AutoscaleError(f"--scale-policy {text}: expected inflight:T or queue:W[,kv:F] (e.g. inflight:32)")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """One autoscaled run's settings (module docstring).

    Args:
        min_replicas: MIN >= 0 (serving from the first arrival).
        max_replicas: MAX >= max(1, MIN).
        policy: the signal and target.
        interval_s: time between decisions, s, > 0.
        up_delay_s: from a decision to add a replica to its first step, s, >= 0.
        down_delay_s: the scale-down stabilisation window, s, >= 0.

    Raises:
        AutoscaleError: a value out of range (named as its flag).
    """

    min_replicas: int
    max_replicas: int
    policy: ScalePolicy
    interval_s: float = DEFAULT_SCALE_INTERVAL_S
    up_delay_s: float = 0.0
    down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S

    def __post_init__(self) -> None:
        parse_autoscale(f"{self.min_replicas}:{self.max_replicas}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise AutoscaleError(f"--scale-interval {self.interval_s:g}: must be a duration > 0")
        for flag, v in (("--scale-up-delay", self.up_delay_s), ("--scale-down-delay", self.down_delay_s)):
            if not (math.isfinite(v) and v >= 0):
                raise AutoscaleError(f"{flag} {v:g}: must be a duration >= 0")

    @property
    def static(self) -> bool:
        """MIN == MAX: nothing can change."""
        return self.min_replicas == self.max_replicas

    def record(self) -> dict[str, Any]:
        """The settings as --json states them (durations in s)."""
        return {"min": self.min_replicas, "max": self.max_replicas, "policy": str(self.policy),
                "scale_interval_s": self.interval_s, "scale_up_delay_s": self.up_delay_s,
                "scale_down_delay_s": self.down_delay_s, "max_added_per_decision": f"max({MAX_ADDED_MIN}, active)"}


def default_up_delay(model: str, gpu: str, tp: int, dtype: str) -> tuple[float, str]:
    """The default scale-up delay, s, and how it was reached: the replica's weight bytes (all its GPUs,
    from the roofline cost model's weight_bytes_per_gpu x tp) over LOAD_BANDWIDTH_BYTES_PER_S.

    Raises:
        CostModelError: an unknown model or GPU, or weights that do not fit.
    """
    from stallfree.costmodel.hardware import get_gpu
    from stallfree.costmodel.model import get_model
    from stallfree.costmodel.roofline import CostModel

    weights = CostModel(get_model(model), get_gpu(gpu), tp=tp, dtype=dtype).weight_bytes_per_gpu * tp
    delay = weights / LOAD_BANDWIDTH_BYTES_PER_S
    return delay, (f"{weights / 1e9:.1f} GB of weights at {LOAD_BANDWIDTH_BYTES_PER_S / 2**20:,.0f} MiB/s, "
                   "an EBS gp3 volume's most")


class Fleet:
    """The autoscaler and the router's door of one run (module docstring). Built by `runner`.

    Attributes:
        state: per slot, OFF, LOADING, SERVING or DRAINING.
        serving: the serving replicas, index order (the list the router sees).
        held: rids waiting at the router for a serving replica.
        timeline: [t_s, serving (draining ones included), loading] at each change.
        replica_s: replica-seconds of the slots not off, from the first arrival to `end_s`.
        first_serving: per slot, the times it started serving.
        decisions: (t_s, signal, desired, target) of each decision.
    """

    def __init__(self, config: AutoscaleConfig, reps: Sequence[Replica], entry: Entry, arrivals: Arrivals) -> None:
        self.config, self.reps, self.entry, self.arrivals = config, list(reps), entry, arrivals
        self.state = [OFF] * len(reps)
        self.serving: list[Replica] = []
        self.held: list[int] = []
        self.arrived = 0
        self.timeline: list[list[float]] = []
        self.replica_s = 0.0
        self.end_s = 0.0
        self._last_t = 0.0
        self._t0 = 0.0
        self._active = 0
        self.served_from: list[list[float]] = [[] for _ in reps]
        self.decisions: list[tuple[float, float, int, int]] = []
        # (t_s, desired) of the decisions within the scale-down delay, oldest first, each desired larger
        # than every later one's (a later, larger or equal one is the window's maximum for longer): the
        # first is the window's largest. A deque, so that a decision costs O(1) amortised, not O(decisions
        # within the delay).
        self._recent: deque[tuple[float, int]] = deque()
        self._ready: dict[int, float] = {}
        self.loop: EventLoop | None = None
        entry.replicas = self.serving  # the router sees the serving replicas alone

    # -- the loop's parts ------------------------------------------------------------------
    def start(self, loop: EventLoop, t0: float) -> None:
        """MIN replicas serve from `t0`, s; the first decision is due at t0 + interval."""
        self.loop, self._last_t, self._t0 = loop, t0, t0
        for rep in self.reps[: self.config.min_replicas]:
            self.state[rep.index] = SERVING
            self.served_from[rep.index].append(t0)
        self._sync()
        self._mark(t0)
        if not self.config.static:
            loop.at(t0 + self.config.interval_s, self.decide)

    def arrive(self, rid: int, now: float) -> None:
        """A request arrives: to the router when a replica serves (or refused for its length), else held."""
        self.arrived += 1
        if self.serving or rid in self.entry.too_long:
            self.entry(rid, now)
        else:
            self.held.append(rid)

    def on_finish(self, replica: Replica, finished: object, end: float) -> None:
        """The loop's finish hook: a draining replica whose last request ended leaves at `end`, s."""
        if self.state[replica.index] == DRAINING:
            self._leave_if_drained(replica, end)

    # -- decisions -------------------------------------------------------------------------
    def signal(self) -> float:
        """The policy's figure now: requests in flight (inflight) or mean waiting per serving replica
        (queue; the larger of it / W and KV usage / F, times W, when F is given)."""
        pol = self.config.policy
        if pol.kind == "inflight":
            return float(sum(r.num_outstanding for r in self.reps) + len(self.held))
        if not self.serving:
            return float(len(self.held))
        waiting = (sum(r.num_waiting for r in self.serving) + len(self.held)) / len(self.serving)
        ratio = waiting / pol.target
        if pol.kv is not None:
            used = [1.0 - r.kv_free / r.kv_total for r in self.serving if r.kv_total]
            if used:
                ratio = max(ratio, sum(used) / len(used) / pol.kv)
        return ratio * pol.target

    def desired(self) -> int:
        """Replicas the policy asks for now, before the bounds and the stabilisation window."""
        pol, sig = self.config.policy, self.signal()
        if pol.kind == "inflight":
            return math.ceil(sig / pol.target - 1e-9)
        if not self.serving:
            return 1 if self.held else 0
        return math.ceil(len(self.serving) * sig / pol.target - 1e-9)

    def decide(self, now: float) -> None:
        """One decision at `now`, s (module docstring), and the next one while work is left.

        Raises:
            AutoscaleError: work is left after SCALE_DECISION_LIMIT decisions (the interval is too short for
                the run).
        """
        cfg = self.config
        for rep in self.reps:
            if self.state[rep.index] == DRAINING:
                self._leave_if_drained(rep, now)
        want = min(max(self.desired(), cfg.min_replicas), cfg.max_replicas)
        recent = self._recent
        while recent and not recent[0][0] > now - cfg.down_delay_s:
            recent.popleft()
        while recent and recent[-1][1] <= want:
            recent.pop()
        recent.append((now, want))
        loading = [r for r in self.reps if self.state[r.index] == LOADING]
        active = len(self.serving) + len(loading)
        target = want
        if want < active:
            target = recent[0][1]
        self.decisions.append((now, self.signal(), want, target))
        if target > active:
            free = [r for r in self.reps if self.state[r.index] == OFF]
            for rep in free[: min(target - active, max(MAX_ADDED_MIN, active))]:
                self._add(rep, now)
        elif target < active:
            drop = active - target
            for rep in sorted(loading, key=lambda r: -self._ready[r.index])[:drop]:
                self.state[rep.index] = OFF
                drop -= 1
            for rep in sorted(self.serving, key=lambda r: (r.num_outstanding, -r.index))[:drop]:
                self.state[rep.index] = DRAINING
                self._leave_if_drained(rep, now)
            self._sync()
        self._mark(now)
        if self.arrived < len(self.arrivals.times) or self.held or any(r.num_outstanding for r in self.reps):
            if len(self.decisions) >= SCALE_DECISION_LIMIT:
                # The command refuses an interval that makes too many over the arrivals; this is the tail
                # after them (a backlog draining, or arrivals all at one instant).
                raise AutoscaleError(
                    f"--scale-interval {cfg.interval_s:g}: more than {SCALE_DECISION_LIMIT:,} scaling decisions, "
                    f"with work left {now - self._t0:,.2f} s after the first arrival: give a longer interval")
            self._at(now + cfg.interval_s, self.decide)

    # -- helpers ---------------------------------------------------------------------------
    def _at(self, t: float, callback: Any) -> None:
        assert self.loop is not None
        self.loop.at(t, callback)

    def _add(self, rep: Replica, now: float) -> None:
        delay = self.config.up_delay_s
        if delay == 0:
            self._serve(rep, now)
            return
        self.state[rep.index] = LOADING
        ready = now + delay
        self._ready[rep.index] = ready
        self._at(ready, lambda t, rep=rep, ready=ready: self._loaded(rep, ready, t))

    def _loaded(self, rep: Replica, ready: float, t: float) -> None:
        # A cancelled (or cancelled and re-added) load does not serve at its old time.
        if self.state[rep.index] == LOADING and self._ready.get(rep.index) == ready:
            self._serve(rep, t)
            self._mark(t)

    def _serve(self, rep: Replica, t: float) -> None:
        self.state[rep.index] = SERVING
        self.served_from[rep.index].append(t)
        self._sync()
        if self.held:
            held, self.held = self.held, []
            for rid in held:
                self.entry(rid, t)

    def _leave_if_drained(self, rep: Replica, t: float) -> None:
        if rep.num_outstanding == 0 and not rep.pending and not rep.busy and not rep.inner.has_unfinished():
            self.state[rep.index] = OFF
            self._mark(t)

    def _sync(self) -> None:
        self.serving[:] = [r for r in self.reps if self.state[r.index] == SERVING]

    def _mark(self, t: float) -> None:
        """Close the replica-seconds up to `t` and note the counts if they changed."""
        self.replica_s += self._active * (t - self._last_t)
        self._last_t = t
        st = self.state
        serving = sum(1 for s in st if s in (SERVING, DRAINING))
        loading = sum(1 for s in st if s == LOADING)
        self._active = serving + loading
        row = [t, serving, loading]
        if self.timeline and self.timeline[-1][1:] == row[1:]:
            return
        if self.timeline and self.timeline[-1][0] == t:
            self.timeline[-1] = row
        else:
            self.timeline.append(row)

    def close(self, end: float) -> None:
        """The run ended at `end`, s (its last step's end): replica-seconds up to it; later rows dropped."""
        self.end_s = end
        keep = [row for row in self.timeline if row[0] <= end]
        self.timeline = keep or self.timeline[:1]
        # Replica-seconds from the rows kept (decisions after the end count nothing).
        total = 0.0
        for a, b in zip(self.timeline, [*self.timeline[1:], [end, 0, 0]], strict=True):
            total += (a[1] + a[2]) * max(0.0, b[0] - a[0])
        self.replica_s = total


def runner(config: AutoscaleConfig, fleets: list[Fleet]) -> Any:
    """A group runner for stallfree.sim.run.cluster.simulate_cluster(group=...): run_group's shape, with the
    autoscaler's Fleet (appended to `fleets`) between the arrivals and the router.

    Raises:
        AutoscaleError: closed-loop load or sessions (not modelled with autoscaling).
    """
    def run(reps: list[Replica], router: Router | None, workload: Workload, max_new: list[int],
            too_long: dict[int, str], closed_loop: ClosedLoop | None) -> tuple[Arrivals, Entry, float]:
        from stallfree.sim.inputs.sessions import SessionWorkload

        if closed_loop is not None or isinstance(workload, SessionWorkload):
            raise AutoscaleError("--autoscale replays open-loop arrivals: drop --concurrency and sessions")
        arrivals = Arrivals(workload, None)
        entry = Entry(reps, router, request_maker(workload, max_new, reps[0].inner, arrivals.times), too_long,
                      arrivals, track_imbalance=router is not None)
        fleet = Fleet(config, reps, entry, arrivals)
        fleets.append(fleet)
        if config.static:
            # Nothing can change: the static run's loop, event for event.
            loop = EventLoop(reps, arrivals, entry, None, PassGate(None))
        else:
            loop = EventLoop(reps, arrivals, fleet.arrive, fleet.on_finish, PassGate(None))
        loop.arrivals_at_step_ends = router is None
        t0 = arrivals.times[0] if arrivals.times else 0.0
        fleet.start(loop, t0)
        if config.static:
            fleet.arrived = len(arrivals.times)
        w0 = time.perf_counter()
        loop.run()
        wall = time.perf_counter() - w0
        ends = [r.res.step_end[-1] for r in reps if len(r.res.step_end)]
        fleet.close(max([*ends, arrivals.times[-1] if arrivals.times else t0]))
        return arrivals, entry, wall

    return run
