"""Calibration: fit the cost model's efficiency factors and overhead terms to measured step times or
to kernel tables, and report the fit error on held-out rows (overall, by token-count bucket and by
kind of step).

Imports allowed: the standard library and stallfree.costmodel.

This module gathers the public names of three smaller ones (each under 400 lines):
- measured.py: MeasuredStep, read_steps_csv (the step CSV format), ErrorStats, the held-out split;
- fit.py: fit_steps (the bounded, regime-alternating least squares) and Calibration;
- profiles.py: kernel tables as published by the Vidur project (MLSys 2024): fit_allreduce (sizes in
  bytes; a fit above the link's peak is refused), steps_from_profile, fit_cpu_overheads, calibrate_profile.
"""

from __future__ import annotations

from stallfree.costmodel.fit import FIT_PARAMS, Calibration, CpuFit, describe, fit_steps
from stallfree.costmodel.measured import BUCKETS, ErrorStats, MeasuredStep, read_steps_csv
from stallfree.costmodel.profiles import (
    BUILTIN_PROFILES,
    PROFILE_FIT,
    AllReduceFit,
    MeasuredAllReduce,
    calibrate_profile,
    fit_allreduce,
    fit_cpu_overheads,
    steps_from_profile,
)

__all__ = [
    "BUCKETS",
    "BUILTIN_PROFILES",
    "FIT_PARAMS",
    "PROFILE_FIT",
    "AllReduceFit",
    "Calibration",
    "CpuFit",
    "ErrorStats",
    "MeasuredAllReduce",
    "MeasuredStep",
    "calibrate_profile",
    "describe",
    "fit_allreduce",
    "fit_cpu_overheads",
    "fit_steps",
    "read_steps_csv",
    "steps_from_profile",
]
