"""The invariant checker's LoRA rules (SchedulerConfig.max_loras): the adapter limit on every plan and on
the running requests. The shadow's admission applies the pass-over rule itself (CheckerState._lora_rule,
from core/lora.py's docstring, worked out from plain lists), so a plan that admits past a request it
should not have, or stops where it should not, differs from the shadow's and is caught there.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from stallfree.core.invariants_state import CheckerState
from stallfree.core.plan import ScheduledChunk

__all__ = ["LoraRules"]


class LoraRules:
    """The adapter limit, checked on each plan and on the running set after each call."""

    @staticmethod
    def check_plan(chk: CheckerState, entries: Iterable[ScheduledChunk]) -> None:
        """The requests of one plan (decodes and chunks) hold at most max_loras distinct adapters."""
        limit = chk.scheduler.config.max_loras
        if limit is None:
            return
        reqs = chk._reqs
        names = {reqs[c.rid].req.lora for c in entries} - {None}
        if len(names) > limit:
            chk._fail("at most max_loras adapters in a step", f"{sorted(map(repr, names))} > {limit}")

    @staticmethod
    def check_running(chk: CheckerState) -> None:
        """The running requests hold at most max_loras distinct adapters, no request was passed over for
        its adapter more than max_lora_passes times, and each waiting request the shadow saw passed has
        the scheduler's count (RequestState.num_lora_passes) of passes."""
        cfg = chk.scheduler.config
        if cfg.max_loras is None:
            return
        names = running_adapters(chk)
        if len(names) > cfg.max_loras:
            chk._fail("at most max_loras adapters running", f"{sorted(map(repr, names))} > {cfg.max_loras}")
        if chk.max_lora_passes_of_one > cfg.max_lora_passes:
            chk._fail("passes bounded", f"{chk.max_lora_passes_of_one} > max_lora_passes {cfg.max_lora_passes}")
        if chk.max_lora_passes_of_one:
            # The requests the shadow saw passed over (few): the scheduler's count is the same.
            s = chk.scheduler
            for rid in chk._waiting:
                sh = chk._reqs[rid]
                if sh.lora_passes and s.request_state(rid).num_lora_passes != sh.lora_passes:
                    chk._fail("passes counted", f"rid {rid!r}: scheduler "
                              f"{s.request_state(rid).num_lora_passes}, shadow {sh.lora_passes}")


def running_adapters(chk: CheckerState) -> set[Hashable]:
    """The adapters of the shadow's running requests (the base model left out)."""
    reqs = chk._reqs
    return {reqs[r].req.lora for r in chk._running} - {None}
