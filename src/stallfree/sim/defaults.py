"""The simulator's own defaults, each written once (the core scheduler's are SchedulerConfig's, in
stallfree.core.config): the token budget and sequence limit of its commands and studies, the KV block
size, and the bundled trace's replay speed-up.

Imports allowed: the standard library only.
"""

from __future__ import annotations

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_SEQS", "DEFAULT_RATE_SCALE", "DEFAULT_TOKEN_BUDGET"]

#: Tokens per step when none is given (vLLM's max_num_batched_tokens default for chunked prefill).
DEFAULT_TOKEN_BUDGET = 2048

#: The most running requests per replica when none is given (vLLM's max_num_seqs default).
DEFAULT_MAX_SEQS = 256

#: Tokens per KV block of the paged scheduler (vLLM's default block size).
DEFAULT_BLOCK_SIZE = 16

#: The default speed-up of the bundled trace (docs/simulator.md explains the choice): under the commands'
#: default pricing (vLLM's kernel tables and the vllm engine profile) the default replica (Llama 3.3 70B,
#: 4 x H100 SXM, FP8) completes about 10.4 req/s when saturated, and 1.4 x the trace's 5.53 req/s =
#: 7.74 req/s is 74% of that: busy but stable (at 3, the scale before kernel pricing, it is 159%).
DEFAULT_RATE_SCALE = 1.4
