"""Former path of `stallfree.sim.inputs.engine_profile`, kept for one release: import from the new path.

An engine profile: the serving engine's own time, which a step priced from its kernels leaves out. Every public name
this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.engine_profile import (
    PROFILES_FILE,
    EngineProfile,
    EngineProfileError,
    ProfiledCostModel,
    default_profile,
    fit_rows,
    load_profile,
    profile_names,
)
from stallfree.sim.run.costs import StepCostModel

__all__ = [
    "EngineProfile",
    "EngineProfileError",
    "PROFILES_FILE",
    "ProfiledCostModel",
    "StepCostModel",
    "default_profile",
    "fit_rows",
    "load_profile",
    "profile_names",
]
