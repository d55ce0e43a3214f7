"""The modules that moved into stallfree.sim's sub-packages still answer at their old paths, for one release:
each such module re-exports, without a warning, the very objects of their new homes."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import stallfree.sim

SHIMS = sorted(
    info.name for info in pkgutil.iter_modules(stallfree.sim.__path__, "stallfree.sim.")
    if not info.ispkg and "kept for one release" in (importlib.import_module(info.name).__doc__ or "")
)


def test_the_documented_old_paths_are_the_new_objects():
    """The four paths the README names give the objects of their new homes."""
    from stallfree.sim.experiment import run_experiment as old_run
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.setup import Setup as OldSetup
    from stallfree.sim.studies.experiment import run_experiment
    from stallfree.sim.studies.sweep import sweep
    from stallfree.sim.studies.tune import tune
    from stallfree.sim.sweep import sweep as old_sweep
    from stallfree.sim.tune import tune as old_tune

    assert (OldSetup, old_run, old_sweep, old_tune) == (Setup, run_experiment, sweep, tune)


@pytest.mark.parametrize("name", SHIMS)
def test_an_old_path_re_exports_objects_defined_elsewhere(name):
    """Every name an old path lists resolves, and each function or class there is defined in another module."""
    module = importlib.import_module(name)
    assert module.__all__
    for attr in module.__all__:
        obj = getattr(module, attr)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ != name, (name, attr)
