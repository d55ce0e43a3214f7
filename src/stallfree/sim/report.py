"""Former path of `stallfree.sim.outputs.report`, kept for one release: import from the new path.

Reports of simulations: the summary (vLLM's serving-benchmark keys plus scheduler figures), per-request and per-step
records, terminal tables and JSON/CSV files. Every public name this module had is re-exported from where it lives
now; the module goes in the next release.
"""

from stallfree.sim.outputs.buckets import bucket_stats, prompt_bucket
from stallfree.sim.outputs.records import request_records, step_records, write_records, write_steps_csv
from stallfree.sim.outputs.report import latency_arrays, slo_met, summarize_result, tenant_stats
from stallfree.sim.outputs.table import console, print_table
from stallfree.sim.run.result import SimResult
from stallfree.sim.run.session_run import session_summary

__all__ = [
    "SimResult",
    "bucket_stats",
    "console",
    "latency_arrays",
    "print_table",
    "prompt_bucket",
    "request_records",
    "session_summary",
    "slo_met",
    "step_records",
    "summarize_result",
    "tenant_stats",
    "write_records",
    "write_steps_csv",
]
