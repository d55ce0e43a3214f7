"""Former path of `stallfree.sim.outputs.buckets`, kept for one release: import from the new path.

Latency by prompt length: TTFT, TPOT and E2E of the requests in each prompt-length bucket, so that what a long-
prompt option does to short prompts (and the reverse) can be read from the report. Every public name this module had
is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.outputs.buckets import PROMPT_BUCKETS, bucket_stats, prompt_bucket, table_rows

__all__ = [
    "PROMPT_BUCKETS",
    "bucket_stats",
    "prompt_bucket",
    "table_rows",
]
