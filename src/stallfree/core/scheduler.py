"""The continuous batching scheduler: a token budget spent on decodes, then the partial prefill,
then strict admission in queue order; its KV memory is a collaborator behind the KVManager protocol.

Imports allowed: the standard library and stallfree.core only.

Scheduler is its step (SchedulerCore, core/scheduler_core.py: the order of a step, the one victim rule and
preemption, the draft-token verbs and the complete() hooks) with its figures read through stats() and the
KV queries (core/queries.py) and its former spellings kept as deprecated aliases (core/aliases.py). The
step is a class of its own because a compiled class has one base (setup.py's NATIVE_MODULES); the mixins
here are read between steps, never inside one.

Source: stall-free batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24);
iteration-level scheduling (Orca, Yu et al., OSDI'22); preemption by recompute (vLLM, Kwon et al.,
SOSP'23).
"""

from __future__ import annotations

from stallfree.core.aliases import SchedulerAliases
from stallfree.core.queries import AdmissionQueries, KVQueries
from stallfree.core.scheduler_core import SchedulerCore

__all__ = ["Scheduler"]


class Scheduler(SchedulerAliases, KVQueries, AdmissionQueries, SchedulerCore):
    """A continuous batching scheduler with a token budget and chunked prefill (docs/DESIGN.md section 1).

    It owns the waiting queue, the running set (a DecodeSet and the partial prefills) and its KV
    manager; it never sees token ids or tensors. Each step is one `schedule()` (a StepPlan) and one
    `complete(plan)`. The budget (a StepBudget) is spent in a fixed order:

    1. decodes: one token for every running request whose prefill is done, oldest admitted first; then
       the draft tokens given by set_draft_tokens, decodes in batch order (speculative decoding: verdicts
       through complete(num_accepted=) or, later, take_back());
    2. the partial prefill: the rest of a prompt started in an earlier step, up to what is left;
    3. admission: waiting requests strictly in queue order (add() order, or priority order); the head
       needs a free slot (running < max_seqs), budget left and the KV manager's yes (`can_admit`); the
       first head that does not fit stops admission.

    A decode or a partial prefill whose KV the manager cannot grow preempts by recompute (`_preempt`)
    the victim the one rule (`_victim`) names: the newest running request admitted after it (the least
    urgent of them, newest first among equals, under policy="priority"), or itself. So the oldest
    running request is never a victim and every run ends; a step that preempted admits nothing. The KV
    policies and every option are described in SchedulerConfig's docstring and docs/scheduling.md.

    Invariants (checked by stallfree.core.invariants.InvariantChecker): scheduled tokens <=
    budget; running <= max_seqs; KV accounting exact; every prompt (episode) gets exactly its
    prefill tokens; every request gets exactly max_new tokens unless stopped or aborted; admission
    in queue order; the decodes of a step are the oldest ready ones; all KV returned at the end.

    Example (the hand trace): budget 8, one decode running, a 20-token prompt arrives::

        step 0: decode + chunk of 7     step 1: decode + chunk of 7
        step 2: decode + chunk of 6 -> the prompt's first token comes out of this (third) step

    Args:
        config: a SchedulerConfig; or, in the keyword form Scheduler(token_budget, max_seqs, kv_tokens,
            **options), the token budget.
        max_seqs, kv_tokens, **options: the keyword form: SchedulerConfig's fields by name (block_size=,
            policy=, num_spec_tokens=, max_num_partial_prefills=, ...).
        kv_manager: None (build the manager the config names, core/kv/factory.py's kv_manager_for), or a
            stallfree.core.kv.KVManager to ask instead, e.g. one delegating to another engine's block
            allocator; the config's KV fields then describe the rules it follows (the invariant
            checker models those), and its kv_total is the scheduler's.

    Attributes (read-only): config and its fields by name (align_chunks and the partial-prefill limits
    resolved); the counters num_preemptions and num_recomputed_tokens.

    Raises:
        InvalidConfig: a field out of range, or a SchedulerConfig given with other options; the message
            names the field and the value (SchedulerConfig).
        TypeError: an option that is not a SchedulerConfig field.
    """
