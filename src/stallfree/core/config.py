"""The core scheduler's configuration: every option under one name, with its default and its check in one place.

Imports allowed: the standard library and stallfree.core only.

`Scheduler(SchedulerConfig(...))` and `Scheduler(token_budget, max_seqs, kv_tokens, **options)` build the
same scheduler: the keyword form makes a SchedulerConfig from its arguments. The names are the contract's
(token_budget, max_seqs, kv_tokens) and vLLM's where it has one (enable_prefix_caching,
max_num_partial_prefills, max_long_partial_prefills, long_prefill_token_threshold, num_spec_tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from stallfree.core.errors import InvalidConfig, check_positive_int

# The checks below (fairness, kv, policies) are imported where they run, so that reading SchedulerConfig's
# defaults (a command's --help) does not import the scheduler's modules.

__all__ = ["SchedulerConfig", "as_config"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Every option of the core scheduler (docs/DESIGN.md section 1; docs/scheduling.md for the options).

    Frozen and checked when made: a SchedulerConfig that exists is valid. Defaults are the contract's:
    KV reserved at admission, FCFS, one partial prefill, no speculation, no caching.

    KV policies (kv_policy=):

    - "reserve" (the contract): prompt_len + max_new tokens reserved at admission, returned when it
      finishes; nothing is ever preempted.
    - "paged": kv_tokens // block_size blocks (rounded down); a request takes blocks as its tokens are
      scheduled; admission needs the blocks of the first chunk while floor(watermark x blocks) stay
      free (waived when nothing runs; a preempted head needs its whole recompute). A decode or a
      partial prefill that cannot get its block preempts by recompute: under policy="fcfs" the most
      recently admitted running request; under "priority" the least urgent among those admitted after
      it (newest first among equals); itself when there is none. So the oldest running request is
      never a victim and every run ends. A victim frees its blocks, returns to the queue (FCFS: at its
      front, in arrival order; priority: by its unchanged priority and aging clock) and, readmitted,
      prefills prompt + generated tokens; a step that preempted admits nothing.

    Attributes:
        token_budget: the most tokens in one step (vLLM's max_num_batched_tokens), an integer >= 1.
        max_seqs: the most running requests (vLLM's max_num_seqs), an integer >= 1.
        kv_tokens: KV cache capacity in tokens, an integer >= 1 (>= block_size when there is one).
        kv_policy: "reserve" or "paged".
        block_size: tokens per KV block, an integer >= 1; required under "paged".
        watermark: "paged": the fraction of blocks kept free at admission, 0 <= watermark < 1.
        align_chunks: every non-final chunk a multiple of block_size. None: on for "reserve" with a
            block_size (which also reserves whole blocks), off for "paged". True needs a block_size.
        policy: "fcfs" or "priority": admission, overflowing decodes and victims ordered by (effective
            priority, arrival), effective = priority - floor(waited / aging_interval).
        priority_ties: "priority": how requests of equal effective priority are ordered: "add" (add()
            order) or "arrival" (Request.arrival, seconds, then add order; for an engine whose requests
            are added out of arrival order, as vLLM's). The same order wherever arrivals follow add().
        aging_interval: "priority": steps (or seconds, with `clock`) of waiting that raise a request's
            priority by one; None: no aging. A number > 0.
        clock: "priority": a callable returning seconds, read once per step, for aging in seconds.
        decode_overflow: "oldest" or "rotate" ("fcfs" only): which ready decodes run when they do not
            all fit the budget.
        num_spec_tokens: speculative tokens per decode, an integer >= 0: a decode costs 1 + min(k,
            max_new - generated - 1, budget - 1) tokens.
        enable_prefix_caching: "paged" only: keep computed prompt blocks for reuse; requests carry
            Request(block_hashes=...) (docs/prefix_caching.md).
        max_num_partial_prefills: K, an integer >= 1: up to K prompts partially prefilled at once.
        max_long_partial_prefills: L, 1 to K (default 1 when K > 1): at most L of them long.
        long_prefill_token_threshold: T, tokens (>= block_size when chunks are aligned): a prompt is
            long while more than T of its tokens are still to compute. With K > 1 and T None, T is 4%
            of max_model_len, at least 1 token (vLLM's default, SchedulerConfig.long_prefill_token_threshold
            in vllm/config/scheduler.py); with neither, InvalidConfig.
        max_model_len: the context length in tokens, or None: read only for T's default (the core
            does not refuse requests by it; the engines and the simulator do).
        cpu_kv_tokens: "paged" with prefix caching: a CPU KV tier of cpu_kv_tokens // block_size
            blocks (stallfree.core.kv_tier.TieredKV: blocks the GPU evicts are kept in host memory and
            loaded back on a hit); 0, the default: none. An integer >= 0, >= block_size when > 0.
        max_loras: the most distinct LoRA adapters (Request.lora) among the running requests, so in
            any one step's plan (vLLM's max_loras), an integer >= 1; None, the default: no limit, and
            plans are those without adapters (stallfree.core.lora, docs/scheduling.md).
        max_lora_passes: with max_loras: the most steps, over a request's life, in which a waiting
            request whose adapter cannot join may be passed over by later requests whose adapters
            can; then it stops admission until its adapter can join. An integer >= 0 (0: strict
            queue order, a blocked adapter blocks the queue). Default 256 steps (about 8 s at 30 ms
            a step): our choice, measured in docs/simulator.md ("LoRA adapters"): on 32 Zipf adapters
            with max_loras 4 it is never reached at 2 or 3.5 requests/s (the runs equal those with
            4,096 steps, in effect vLLM's unbounded pass-over), and it keeps 77% of that rule's burst
            capacity (32 steps: 46%; 0: 21%).
        fairness: "fcfs" (the default: one queue, tenants ignored, the contract) or "vtc": admission takes
            the oldest waiting request of the tenant (Request.tenant) with the least weighted service in
            tokens (stallfree.core.fairness, Sheng et al., OSDI'24); FCFS within a tenant. Needs
            policy="fcfs", max_num_partial_prefills=1 and no max_loras.
        tenant_weights: "vtc": tenant name -> weight (a finite number > 0); a tenant with weight 2 is
            served twice the tokens of one with weight 1 while both wait. None: every tenant 1.0.
        max_queue_time_s: None (no limit), seconds for every request, or tenant name -> seconds (tenants
            not named: no limit). A request never admitted that has waited longer (clock() minus its
            arrival, read once per step) is finished with FinishReason "timeout", named in the plan's
            `timed_out`; a preempted request is never timed out. Needs `clock`; any policy.
        tenant_chunk_tokens: "vtc": C, tokens, or None (the default; the commands' --fairness vtc sets
            768): a prompt chunk of a tenant that leads (another tenant with requests running or waiting
            was served fewer tokens per weight) keeps the step within C tokens, decodes and earlier
            chunks counted (at least C // 4 in whole blocks), and a step that sets a less-served tenant's
            head aside beside a partial prefill gives the partial prefill no chunk
            (stallfree.core.fairness, "Isolation"). An integer >= 1 (>= block_size when chunks are
            aligned); not with cpu_kv_tokens.
        tenant_burst_tokens: "vtc": B, tokens, an integer >= 0 (default 0): the lift leaves a tenant
            that was idle B / weight below the least waiting counter, so it may be served B tokens before
            the others are served again (stallfree.core.fairness, "Burst").

    Raises:
        InvalidConfig: any field out of range or of the wrong type, or options that do not go together
            (an unknown kv_policy, "paged" without block_size, caching without "paged", kv_tokens or
            an aligned token_budget below block_size, ...); the message names the field and the value.
    """

    token_budget: int
    max_seqs: int
    kv_tokens: int
    kv_policy: str = "reserve"
    block_size: int | None = None
    watermark: float = 0.01
    align_chunks: bool | None = None
    policy: str = "fcfs"
    aging_interval: float | None = None
    clock: Callable[[], float] | None = None
    decode_overflow: str = "oldest"
    num_spec_tokens: int = 0
    enable_prefix_caching: bool = False
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    priority_ties: str = "add"
    max_model_len: int | None = None
    cpu_kv_tokens: int = 0
    max_loras: int | None = None
    max_lora_passes: int = 256
    fairness: str = "fcfs"
    tenant_weights: Mapping[str, float] | None = None
    max_queue_time_s: float | Mapping[str, float] | None = None
    tenant_chunk_tokens: int | None = None
    tenant_burst_tokens: int = 0

    def __post_init__(self) -> None:
        from stallfree.core.fairness import check_fairness, check_isolation
        from stallfree.core.kv.options import check_kv_options
        from stallfree.core.policies import build_policies, check_partial_prefills

        check_positive_int("token_budget", self.token_budget)
        check_positive_int("max_seqs", self.max_seqs)
        check_positive_int("kv_tokens", self.kv_tokens)
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len)
        aligned, _ = check_kv_options(
            self.kv_policy, self.block_size, self.align_chunks, self.watermark, self.enable_prefix_caching)
        chunk = self.block_size if aligned else None
        build_policies(chunk, self.policy, self.aging_interval, self.clock, self.decode_overflow, self.num_spec_tokens,
                       clock_needed=self.max_queue_time_s is not None)
        check_fairness(self.fairness, self.tenant_weights, self.max_queue_time_s, policy=self.policy,
                       max_num_partial_prefills=self.max_num_partial_prefills, clock=self.clock)
        check_isolation(self.fairness, self.tenant_chunk_tokens, self.tenant_burst_tokens, chunk,
                        self.cpu_kv_tokens)
        for name in ("tenant_weights", "max_queue_time_s"):
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a copy, so that the caller's dict cannot change a checked config
                object.__setattr__(self, name, {str(k): float(v) for k, v in value.items()})
        check_partial_prefills(
            self.max_num_partial_prefills, self.max_long_partial_prefills, self._threshold(), chunk)
        self._check_cpu_tier()
        if self.max_loras is not None:
            check_positive_int("max_loras", self.max_loras)
        mp = self.max_lora_passes
        if isinstance(mp, bool) or not isinstance(mp, int) or mp < 0:
            raise InvalidConfig(f"max_lora_passes must be an integer >= 0 (steps), got {mp!r}")
        if self.max_loras is not None and self.fairness != "fcfs":
            # VTC picks the next request by tenant service and LoRA passes over requests whose adapter
            # cannot join: two reorderings of one queue whose bounds were each proved alone.
            raise InvalidConfig(f"max_loras={self.max_loras!r} (the LoRA adapter limit) does not go with "
                                f"fairness={self.fairness!r}; use fairness='fcfs' with adapters")
        if self.priority_ties not in ("add", "arrival"):
            raise InvalidConfig(f"priority_ties must be 'add' or 'arrival', got {self.priority_ties!r}")
        bs = self.block_size
        if bs is not None and self.kv_tokens < bs:
            raise InvalidConfig(f"kv_tokens ({self.kv_tokens}) must be >= block_size ({bs}): the KV cache holds "
                                "no block")
        if bs is not None and aligned and self.token_budget < bs:
            raise InvalidConfig(f"token_budget ({self.token_budget}) must be >= block_size ({bs}) when chunks are "
                                "aligned to blocks")

    def _threshold(self) -> int | None:
        """T as given, or its default: 4% of max_model_len (at least 1) when K > 1 and T is None."""
        t = self.long_prefill_token_threshold
        if t is None and self.max_num_partial_prefills != 1 and self.max_model_len is not None:
            return max(1, self.max_model_len * 4 // 100)
        return t

    def _check_cpu_tier(self) -> None:
        tier = self.cpu_kv_tokens
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            raise InvalidConfig(f"cpu_kv_tokens must be an integer >= 0, got {tier!r}")
        if not tier:
            return
        if self.kv_policy != "paged" or not self.enable_prefix_caching:
            raise InvalidConfig(f"cpu_kv_tokens={tier} (a CPU KV tier of prefix-cache blocks) needs "
                                f"kv_policy='paged' and enable_prefix_caching=True, got "
                                f"kv_policy={self.kv_policy!r}, enable_prefix_caching={self.enable_prefix_caching!r}")
        assert self.block_size is not None  # "paged" has one (check_kv_options)
        if tier < self.block_size:
            raise InvalidConfig(f"cpu_kv_tokens={tier} holds no block of block_size={self.block_size} tokens")

    @property
    def cpu_blocks(self) -> int:
        """Blocks of the CPU KV tier: cpu_kv_tokens // block_size (0: none)."""
        return self.cpu_kv_tokens // self.block_size if self.cpu_kv_tokens and self.block_size else 0

    @property
    def chunks_aligned(self) -> bool:
        """align_chunks resolved: True when every non-final chunk is a multiple of block_size."""
        from stallfree.core.kv.options import check_kv_options

        return check_kv_options(
            self.kv_policy, self.block_size, self.align_chunks, self.watermark, self.enable_prefix_caching)[0]

    @property
    def chunk_alignment(self) -> int | None:
        """block_size when chunks are aligned, else None (tokens)."""
        return self.block_size if self.chunks_aligned else None

    @property
    def partial_prefill_limits(self) -> tuple[int, int, int | None]:
        """(K, L, T) with the defaults filled in: (1, 1, None) for the contract's one partial prefill."""
        from stallfree.core.policies import check_partial_prefills

        return check_partial_prefills(
            self.max_num_partial_prefills, self.max_long_partial_prefills, self._threshold(), self.chunk_alignment)

    def replace(self, **changes: Any) -> SchedulerConfig:
        """A copy with `changes` applied, checked again.

        Raises:
            InvalidConfig: the result is not a valid configuration.
            TypeError: a name that is not a field.
        """
        return SchedulerConfig(**{**self.as_dict(), **changes})  # dataclasses.replace, with TypeError for a bad name

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, as given (align_chunks and the partial-prefill limits unresolved)."""
        return dict(vars(self))

    def resolved(self) -> dict[str, Any]:
        """The fields with every derived default filled in (align_chunks, L and T), for reports and
        `--json` (`scheduler_config`); `clock` as its name, or None; the tenant options (fairness,
        tenant_weights, max_queue_time_s, tenant_chunk_tokens, tenant_burst_tokens) only when set. JSON-serialisable."""
        out = self.as_dict()
        for name, default in _LEFT_OUT_AT_DEFAULT.items():
            if out[name] == default:
                del out[name]  # a run without tenants reports the configuration it always did
        k, lng, thr = self.partial_prefill_limits
        out.update(align_chunks=self.chunks_aligned, max_long_partial_prefills=lng, long_prefill_token_threshold=thr)
        if self.clock is not None:
            out["clock"] = getattr(self.clock, "__qualname__", repr(self.clock))
        if self.max_loras is None:
            # Without adapters the record is the one it was before LoRA existed.
            del out["max_loras"], out["max_lora_passes"]
        return out


#: Fields left out of resolved() while at their default: the tenant options.
_LEFT_OUT_AT_DEFAULT: dict[str, Any] = {"fairness": "fcfs", "tenant_weights": None, "max_queue_time_s": None,
                                        "tenant_chunk_tokens": None, "tenant_burst_tokens": 0}


def as_config(
    config: SchedulerConfig | int | None, max_seqs: int | None, kv_tokens: int | None, options: Mapping[str, Any]
) -> SchedulerConfig:
    """The SchedulerConfig of Scheduler(...)'s arguments: `config` itself, or one made from the keyword form.

    Args:
        config: a SchedulerConfig (then nothing else may be given), or the token budget, or None (then
            token_budget comes as a keyword in `options`).
        max_seqs, kv_tokens: the keyword form's positional arguments, or None (then in `options`).
        options: the keyword form's other options, by SchedulerConfig field name.

    Raises:
        InvalidConfig: a SchedulerConfig together with other arguments, or a field out of range.
        TypeError: an option that is not a SchedulerConfig field, or a missing required one.
    """
    if isinstance(config, SchedulerConfig):
        if max_seqs is not None or kv_tokens is not None or options:
            given = [k for k, v in (("max_seqs", max_seqs), ("kv_tokens", kv_tokens)) if v is not None]
            raise InvalidConfig(f"Scheduler(config) takes no other options; got {given + sorted(options)}")
        return config
    args = dict(options)
    unknown = sorted(k for k in args if k not in _FIELDS)
    if unknown:
        raise TypeError(f"Scheduler() got an unexpected option {unknown[0]!r}: the options are SchedulerConfig's "
                        f"fields ({', '.join(sorted(_FIELDS))})")
    for name, value in (("token_budget", config), ("max_seqs", max_seqs), ("kv_tokens", kv_tokens)):
        if name not in args:
            args[name] = value  # None is refused by the field's check, naming it
        elif value is not None:
            raise TypeError(f"Scheduler() got multiple values for argument {name!r}")
    return SchedulerConfig(**args)


#: SchedulerConfig's field names: the options Scheduler() takes by keyword.
_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))
