"""Former path of `stallfree.sim.outputs.writers`, kept for one release: import from the new path.

Every file and plot the simulator's commands write under --out (and with --records): above the studies (experiment,
sweep, tune, kv_sweep, cluster, disagg) and the event loop, which write nothing. Every public name this module had
is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.disagg_report import RECORD_FIELDS, disagg_records
from stallfree.sim.outputs.records import write_records, write_steps_csv
from stallfree.sim.outputs.writers import (
    PLAN_CSV_KEYS,
    write_disagg_out,
    write_disagg_records,
    write_experiment,
    write_json,
    write_kv_sweep,
    write_plan,
    write_sweep,
    write_tune,
)
from stallfree.sim.run.cluster import ClusterResult
from stallfree.sim.run.disagg import DisaggResult
from stallfree.sim.studies.experiment import Experiment, run_tag
from stallfree.sim.studies.kv_sweep import kv_sweep_title
from stallfree.sim.studies.sweep import ROW_KEYS, SweepResult
from stallfree.sim.studies.tune import TuneResult
from stallfree.sim.studies.tune_report import tune_report

__all__ = [
    "ClusterResult",
    "DisaggResult",
    "Experiment",
    "PLAN_CSV_KEYS",
    "RECORD_FIELDS",
    "ROW_KEYS",
    "SweepResult",
    "TuneResult",
    "Workload",
    "disagg_records",
    "kv_sweep_title",
    "run_tag",
    "tune_report",
    "write_disagg_out",
    "write_disagg_records",
    "write_experiment",
    "write_json",
    "write_kv_sweep",
    "write_plan",
    "write_records",
    "write_steps_csv",
    "write_sweep",
    "write_tune",
]
