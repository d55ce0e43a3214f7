"""Shared pytest configuration: a reproducible Hypothesis profile for slow machines."""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "stallfree",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("stallfree")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "pure_python: needs the pure-Python build (it replaces a method of a class that the compiled "
        "build, setup.py's regular install, compiles, which compiled callers never see, or reads its source): "
        "skipped under the compiled build")


def pytest_runtest_setup(item):
    if item.get_closest_marker("pure_python") is not None:
        from stallfree._native import compiled

        if compiled():
            pytest.skip("needs the pure-Python build: it patches or reads the source of a compiled class")



def pytest_collection_modifyitems(config, items):
    """Refuse test ids that hold a memory address (an object's default repr, e.g. `ids=str` over
    functions): pytest-xdist's workers would collect different ids and the whole run would stop."""
    bad = [item.nodeid for item in items if " at 0x" in item.nodeid]
    if bad:
        raise pytest.UsageError("test ids must not hold memory addresses; name them: " + ", ".join(bad[:5]))
