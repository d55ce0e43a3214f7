"""Shared pytest configuration: a reproducible Hypothesis profile for slow machines."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "stallfree",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("stallfree")
