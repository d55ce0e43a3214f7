"""An engine profile: the serving engine's own time, which a step priced from its kernels leaves out.

Imports allowed: the standard library, stallfree.core, stallfree.sim.run.costs.

Three named terms, each in seconds (the data file gives them in ms and us):

- ``step_s``: a cost per step around the kernels (the engine's scheduling, input preparation, sampling
  set-up and output processing on the CPU, and what asynchronous scheduling does not hide of it). It is
  added to every non-empty step.
- ``per_sampled_s``: a cost per request that samples a token in the step (each decode, and each last
  prefill chunk): the per-request part of the engine core's CPU work (its input rows, sampling, appending
  the token). Detokenizing and streaming run in the API server's process, off the step's critical path.
  Added once per sampled token of the step.
- ``frontend_s``: a front-end cost per request before its first token reaches the client (HTTP,
  tokenization, hand-off to the engine core, the first streamed chunk). It is not a step: it is added to
  a request's TTFT and E2E where latencies are the client's (a `vllm bench serve` result, a closed-loop
  benchmark row, and every `simulate`, `sweep`, `tune` and cluster run, whose latencies are reported as a
  benchmark client would measure them), and in a closed loop it also delays the engine's view of each new
  request, like a think time. It is not added to runs whose times are the engine's own timestamps (a run
  folder's ``queued_ts`` is taken after tokenization, in the engine core).

A profile is data: ``sim/data/engine_profiles.json`` holds each named profile with the figures, the rows it
was fitted on and the command that fitted it (docs/fidelity.md). ``none`` is the profile with no terms.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from stallfree.core.errors import StallfreeError
from stallfree.core.plan import StepPlan
from stallfree.sim.run.costs import InnerPlainPricing, StepCostModel

__all__ = [
    "PROFILES_FILE",
    "EngineProfile",
    "EngineProfileError",
    "ProfiledCostModel",
    "default_profile",
    "fit_rows",
    "load_profile",
    "profile_names",
]

#: The data file of the shipped profiles (inside stallfree/sim/data).
PROFILES_FILE = "engine_profiles.json"


class EngineProfileError(StallfreeError, ValueError):
    """An unknown profile name, or a profile file with a bad field (the message names it)."""


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """The engine's own time, in three terms (module docstring).

    Attributes:
        name: the profile's name ("none", "vllm", ...).
        step_s: seconds added to every non-empty step, >= 0.
        per_sampled_s: seconds added per token sampled in a step, >= 0.
        frontend_s: seconds added to each request's TTFT (and E2E) where the client measures, >= 0.
        pricing: what priced the steps the terms were fitted on ("none": today's pricing; "vllm":
            the kernel tables), so that a profile is used with the pricing it was fitted on.
        fitted_on: a description of the rows the terms were fitted on.
        command: the command that fitted them.
        notes: anything else the data file says.
        version: the fit's version ("" when not given): the data file's number, raised at each refit, so
            that a report says which fit of the profile it used.

    Raises:
        EngineProfileError: a term is negative or not a finite number.
    """

    name: str
    step_s: float = 0.0
    per_sampled_s: float = 0.0
    frontend_s: float = 0.0
    pricing: str = "none"
    fitted_on: str = ""
    command: str = ""
    notes: tuple[str, ...] = field(default=())
    version: str = ""

    def __post_init__(self) -> None:
        for name in ("step_s", "per_sampled_s", "frontend_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise EngineProfileError(f"engine profile {self.name!r}: {name} must be a finite number >= 0, "
                                         f"got {v!r}")

    @property
    def is_empty(self) -> bool:
        """True when every term is 0 (the profile changes nothing)."""
        return self.step_s == 0 and self.per_sampled_s == 0 and self.frontend_s == 0

    def describe(self) -> str:
        """One line for a report: the name (with the version, where the data file gives one) and the terms
        in ms / us."""
        named = f"engine profile {self.name}" + (f" version {self.version}" if self.version else "")
        if self.is_empty:
            return f"{named}: no terms"
        return (f"{named}: {self.step_s * 1e3:.3f} ms per step, "
                f"{self.per_sampled_s * 1e6:.1f} us per sampled token, {self.frontend_s * 1e3:.2f} ms front end "
                "per request")

    def to_json(self) -> dict[str, Any]:
        """The profile as the data file's entry (ms and us)."""
        return {
            "step_ms": self.step_s * 1e3,
            "per_sampled_token_us": self.per_sampled_s * 1e6,
            "frontend_ms": self.frontend_s * 1e3,
            "pricing": self.pricing,
            "fitted_on": self.fitted_on,
            "command": self.command,
            "notes": list(self.notes),
            **({"version": self.version} if self.version else {}),
        }

    @classmethod
    def from_json(cls, name: str, data: Any) -> EngineProfile:
        """Build a profile from a data-file entry (step_ms, per_sampled_token_us, frontend_ms, ...).

        Raises:
            EngineProfileError: the entry is not an object or a field is not a number (named).
        """
        if not isinstance(data, dict):
            raise EngineProfileError(f"engine profile {name!r}: the entry must be an object, got {type(data).__name__}")
        terms: dict[str, float] = {}
        for key, scale, attr in (("step_ms", 1e-3, "step_s"), ("per_sampled_token_us", 1e-6, "per_sampled_s"),
                                 ("frontend_ms", 1e-3, "frontend_s")):
            v = data.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise EngineProfileError(f"engine profile {name!r}: {key} must be a number, got {v!r}")
            terms[attr] = float(v) * scale
        notes = data.get("notes", [])
        return cls(name=name, pricing=str(data.get("pricing", "none")), fitted_on=str(data.get("fitted_on", "")),
                   command=str(data.get("command", "")), version=str(data.get("version", "")),
                   notes=tuple(str(n) for n in notes) if isinstance(notes, list) else (str(notes),), **terms)


def _shipped() -> dict[str, Any]:
    text = resources.files("stallfree.sim").joinpath("data", PROFILES_FILE).read_text(encoding="utf-8")
    data = json.loads(text)
    profiles = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, dict):
        raise EngineProfileError(f"{PROFILES_FILE}: no 'profiles' object")
    return profiles


def profile_names() -> tuple[str, ...]:
    """The names of the shipped profiles, "none" first."""
    return ("none", *sorted(n for n in _shipped() if n != "none"))


def load_profile(name: str) -> EngineProfile:
    """Return the shipped profile `name` ("none": no terms).

    Raises:
        EngineProfileError: no profile of that name (the message lists the names), or a bad entry.
    """
    if name == "none":
        return EngineProfile("none")
    profiles = _shipped()
    if name not in profiles:
        raise EngineProfileError(f"`engine_profile` {name!r}: no such profile; known: {', '.join(profile_names())}")
    return EngineProfile.from_json(name, profiles[name])


def fit_rows(profile: EngineProfile | None) -> dict[str, Any] | None:
    """The benchmark rows a shipped profile was fitted on, as its data file's `fit_rows` selection
    ({"engine", "mode", "model_contains", "gpu": [presets]}), or None: no profile, an empty one, or one
    the data file does not describe (a profile built by hand fits nothing of the package's)."""
    if profile is None or profile.is_empty:
        return None
    entry = _shipped().get(profile.name)
    found = entry.get("fit_rows") if isinstance(entry, dict) else None
    return dict(found) if isinstance(found, dict) else None


def default_profile(kernels: str | None) -> EngineProfile:
    """The profile that matches a `--kernels` value: the shipped profile named after its engine when that
    profile was fitted on that engine's kernel pricing; "none" for `--kernels none` (or None) and for an
    engine without one.

    Raises:
        EngineProfileError: a bad entry in the data file.
    """
    if kernels is None or kernels == "none":
        return EngineProfile("none")
    engine = kernels.split(":", 1)[0]
    shipped = _shipped()
    if engine in shipped:
        prof = EngineProfile.from_json(engine, shipped[engine])
        if prof.pricing.split(":", 1)[0] == engine:
            return prof
    return EngineProfile("none")


@dataclass(frozen=True, slots=True)
class ProfiledCostModel(InnerPlainPricing):
    """A step cost model plus a profile's step terms: inner + step_s + per_sampled_s x sampled tokens.

    The front-end term is not a step's: a simulation records ``frontend_s`` in its result's config and the
    report adds it to every TTFT and E2E (the client's view: in an open loop a constant delay before the
    engine sees a request changes no step, so adding it afterwards is exact).
    An empty plan costs what the inner model says (0).

    Args:
        inner: the kernels' (or today's) step pricing.
        profile: the engine profile.
    """

    inner: StepCostModel
    profile: EngineProfile

    @property
    def frontend_s(self) -> float:
        """The profile's front-end time per request, s: a simulation adds it to each request's TTFT and
        E2E (stallfree.sim.outputs.report.latency_arrays reads it from the result's config)."""
        return self.profile.frontend_s

    def _plain_times(self, times: list[float], num_decodes: int) -> list[float]:
        """The inner model's prices of decode-only steps with the profile's terms, as step_time adds them."""
        p = self.profile
        return [t + p.step_s + p.per_sampled_s * num_decodes for t in times] if num_decodes else times

    def bind_replica(self, res: Any) -> StepCostModel:
        """A replica's pricer: the inner model's own, when it binds one (a kernel model's step cache, a
        LoRA adapter residency), with the same profile; else this model."""
        bind = getattr(self.inner, "bind_replica", None)
        return self if bind is None else ProfiledCostModel(bind(res), self.profile)

    def step_time(self, plan: StepPlan) -> float:
        """Return the step's time, s: the inner price plus the profile's per-step and per-sampled terms."""
        t = self.inner.step_time(plan)
        if plan.num_tokens == 0:
            return t
        p = self.profile
        sampled = plan.num_decodes
        for c in plan.prefills:  # a loop, not sum() over a generator: this runs once a step
            if c.is_last:
                sampled += 1
        return t + p.step_s + p.per_sampled_s * sampled

