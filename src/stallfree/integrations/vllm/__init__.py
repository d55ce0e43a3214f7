"""stallfree's scheduler inside vLLM: scheduler classes for `vllm serve --scheduler-cls` (docs/vllm.md).

Imports allowed: the standard library, stallfree.core and vLLM 0.33 (the `vllm` extra); importing this
package checks the vLLM version first (stallfree.integrations.vllm._version).

- Scheduler: a subclass of vLLM's AsyncScheduler (async scheduling stays on) whose step policy is
  stallfree.core.Scheduler's; `--scheduler-cls stallfree.integrations.vllm.Scheduler`.
- SyncScheduler: the same policy on vLLM's synchronous Scheduler.

Options: vLLM's own flags (--max-num-batched-tokens, --max-num-seqs, --scheduling-policy,
--long-prefill-token-threshold, --enable-prefix-caching, --watermark) and stallfree's through
`--additional-config '{"stallfree": {...}}'` (stallfree.integrations.vllm.config).
"""

from stallfree.integrations.vllm._version import check_vllm

check_vllm()

from stallfree.integrations.vllm.config import StallfreeOptions  # noqa: E402
from stallfree.integrations.vllm.scheduler import Scheduler, SyncScheduler  # noqa: E402

__all__ = ["Scheduler", "StallfreeOptions", "SyncScheduler"]
