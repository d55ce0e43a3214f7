"""Every error the project raises on purpose derives from stallfree.StallfreeError and keeps its built-in base."""

import importlib

import pytest

import stallfree

ERRORS = [
    ("stallfree.core.errors", "RequestRejected", ValueError),
    ("stallfree.core.errors", "InvalidConfig", ValueError),
    ("stallfree.core.errors", "SchedulerStateError", RuntimeError),
    ("stallfree.core.invariants", "InvariantViolation", AssertionError),
    ("stallfree.costmodel.errors", "CostModelError", ValueError),
    ("stallfree.sim.simulator", "SimulationError", RuntimeError),
    ("stallfree.sim.workload", "TraceError", ValueError),
    ("stallfree.sim.setup", "SetupError", ValueError),
    ("stallfree.sim.tune_bound", "TargetBelowFloor", ValueError),
    ("stallfree.sim.commands.common", "CliError", Exception),
    ("stallfree.engine.errors", "EngineError", ValueError),
    ("stallfree.engine.errors", "StepFailed", RuntimeError),
    ("stallfree.server.options", "ServerConfigError", ValueError),
]


@pytest.mark.parametrize(("module", "name", "builtin"), ERRORS, ids=[e[1] for e in ERRORS])
def test_error_derives_from_the_one_base(module, name, builtin):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, stallfree.StallfreeError)
    assert issubclass(cls, builtin)


def test_a_bad_config_is_caught_by_the_base():
    with pytest.raises(stallfree.StallfreeError, match="token_budget"):
        stallfree.Scheduler(0, 1, 1)
