"""Every error the project raises on purpose derives from stallfree.StallfreeError and keeps its built-in base."""

import importlib
import inspect
import pkgutil

import pytest

import stallfree

ERRORS = [
    ("stallfree.core.errors", "RequestRejected", ValueError),
    ("stallfree.core.errors", "InvalidConfig", ValueError),
    ("stallfree.core.errors", "SchedulerStateError", RuntimeError),
    ("stallfree.core.invariants_state", "InvariantViolation", AssertionError),
    ("stallfree.costmodel.errors", "CostModelError", ValueError),
    ("stallfree.sim.run.result", "SimulationError", RuntimeError),
    ("stallfree.sim.inputs.workload", "TraceError", ValueError),
    ("stallfree.sim.inputs.options", "SetupError", ValueError),
    ("stallfree.sim.studies.tune_bound", "TargetBelowFloor", ValueError),
    ("stallfree.sim.run.result", "ClusterError", ValueError),
    ("stallfree.sim.studies.executors", "ExecutorError", RuntimeError),
    ("stallfree.sim.commands.common", "CliError", Exception),
    ("stallfree.engine.errors", "EngineError", ValueError),
    ("stallfree.engine.errors", "StepFailed", RuntimeError),
    ("stallfree.server.options", "ServerConfigError", ValueError),
]


def _error_classes():
    """(module, name, class) of every exception class defined in an importable stallfree module.

    Warnings are not errors and are left out; a module whose optional dependency (torch, an HTTP
    library) is missing is skipped, since nothing in it can be raised then.
    """
    found = []
    for info in pkgutil.walk_packages(stallfree.__path__, "stallfree."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] == "stallfree":
                raise
            continue
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
                    and obj.__module__ == info.name):
                found.append((info.name, name, obj))
    return found


@pytest.mark.parametrize(("module", "name", "builtin"), ERRORS, ids=[e[1] for e in ERRORS])
def test_error_derives_from_the_one_base(module, name, builtin):
    """Each listed error derives from StallfreeError and from the built-in class callers catch it by."""
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, stallfree.StallfreeError)
    assert issubclass(cls, builtin)


def test_every_error_class_of_every_module_derives_from_the_base():
    """Walking every module: each exception class defined in stallfree derives from StallfreeError."""
    found = _error_classes()
    names = {(m, n) for m, n, _ in found}
    assert {(m, n) for m, n, _ in ERRORS if not m.startswith("stallfree.engine")} <= names  # the walk sees them
    strays = [f"{m}.{n}" for m, n, cls in found if not issubclass(cls, stallfree.StallfreeError)]
    assert strays == []


def test_a_bad_config_is_caught_by_the_base():
    """A constructor error of the core is caught by `except StallfreeError`."""
    with pytest.raises(stallfree.StallfreeError, match="token_budget"):
        stallfree.Scheduler(0, 1, 1)
