"""Former path of `stallfree.sim.inputs.engine_behaviour`, kept for one release: import from the new path.

How the engine whose kernel tables price a run schedules: the scheduler defaults a run takes from it. Every public
name this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.engine_behaviour import (
    ASYNC_SCHEDULING_DEFAULT_SINCE,
    BEHAVIOUR_FIELDS,
    CONTRACT_FLAGS,
    ENGINE_RULES,
    VLLM_ADMISSION_RULE,
    async_default,
    behaviour_line,
    engine_defaults,
)

__all__ = [
    "ASYNC_SCHEDULING_DEFAULT_SINCE",
    "BEHAVIOUR_FIELDS",
    "CONTRACT_FLAGS",
    "ENGINE_RULES",
    "VLLM_ADMISSION_RULE",
    "async_default",
    "behaviour_line",
    "engine_defaults",
]
