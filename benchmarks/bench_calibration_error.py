"""Calibrated error of the cost model on the shipped A100 / CodeLlama-34B kernel tables, held-out rows,
by token-count bucket and by kind of step: the old overhead shape (one constant per step) beside the
new one (per kernel launch, per token, per sequence).

Run: PYTHONPATH=src python benchmarks/bench_calibration_error.py
"""

from __future__ import annotations

from stallfree.costmodel import CostModel
from stallfree.costmodel.calibrate import PROFILE_FIT, MeasuredAllReduce, fit_allreduce, fit_steps, steps_from_profile
from stallfree.costmodel.profiles import _profile_dir, _table


def main() -> None:
    """Print one table row per fitted parameter set."""
    base = CostModel.from_names("codellama-34b", "a100-sxm-80gb", tp=2, dtype="fp16")
    folder, _ = _profile_dir("a100-codellama34b-tp2")
    rows = _table(folder, "all_reduce.csv")
    ar = fit_allreduce(rows, base)
    base = base.replace(link_util=ar.link_util, allreduce_latency_s=ar.latency_s)
    steps = steps_from_profile("a100-codellama34b-tp2", base, MeasuredAllReduce.of(rows, base.tp))
    print(f"{len(steps)} composed steps; held-out 20% (seed 0); |error| median / p90 per group")
    for fit in (("mfu", "mbu", "overhead_s"), PROFILE_FIT):
        cal = fit_steps(base, steps, fit)
        groups = (*cal.test_by_bucket, *cal.test_by_kind)
        print(", ".join(fit))
        print("   " + "  ".join(f"{k}: {v.median:.1%}/{v.p90:.1%}" for k, v in groups))
    print("floor (no fit)")
    print("   " + "  ".join(f"{k}: {v.median:.1%}/{v.p90:.1%}" for k, v in cal.floor_by_bucket))


if __name__ == "__main__":
    main()
