"""Names kept from before the commands moved to stallfree.sim.commands (CHANGELOG.md says where each
went): the commands' registration and the defaults that benchmarks import from here.

Imports allowed: stallfree.sim.
"""

from __future__ import annotations

from stallfree.sim.commands import register
from stallfree.sim.commands.common import CliError
from stallfree.sim.setup import DEFAULT_RATE_SCALE, DEFAULTS, TIME_BUDGET_CAP, default_cost_model

__all__ = ["DEFAULTS", "DEFAULT_RATE_SCALE", "TIME_BUDGET_CAP", "CliError", "default_cost_model", "register"]
