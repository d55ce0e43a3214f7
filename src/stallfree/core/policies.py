"""The scheduler's options as small hook objects, each replacing one decision of the contract.

Imports allowed: the standard library only.

- chunking (block_size=): how many prompt tokens a chunk may take;
- waiting queue (policy=, aging_interval=, clock=): which waiting request is the head;
- decode selection (decode_overflow=, policy=): which ready decodes run when they do not all fit.

Scheduler(...) builds one of each from its keywords (see `build_policies`); schedule() calls them and
holds no per-option flags.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import InvalidConfig, check_positive_int

__all__ = [
    "BlockAlignedChunks",
    "ExactChunks",
    "FCFSQueue",
    "OldestFirst",
    "PriorityQueue",
    "Rotate",
    "build_policies",
    "check_partial_prefills",
]


class Chunking(Protocol):
    """How prompt chunks are cut (the KV policies in core/kv.py count the KV); `block_size` is the
    alignment of non-final chunks in tokens, or None for exact chunks."""

    @property
    def block_size(self) -> int | None: ...

    def chunk(self, rest: int, left: int) -> int: ...


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class ExactChunks:
    """The base contract: a chunk takes min(rest of the prompt, budget left)."""

    block_size: int | None = None

    def chunk(self, rest: int, left: int) -> int:
        """Tokens of a prompt with `rest` tokens left that fit in `left` tokens of budget."""
        return rest if rest <= left else left


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class BlockAlignedChunks:
    """Block-aligned chunks: every non-final chunk is a multiple of block_size; the final one is exact.

    Since every earlier chunk was a whole number of blocks, each non-final chunk also ends on a block
    boundary, so a chunk's KV never shares a block with the next chunk's. (The reservation policy then
    reserves whole blocks: stallfree.core.kv.ReservationKV.)
    """

    def __init__(self, block_size: object) -> None:
        self.block_size = check_positive_int("block_size", block_size)

    def chunk(self, rest: int, left: int) -> int:
        """The whole rest if it fits, else `left` rounded down to blocks (0 means: not this step)."""
        if rest <= left:
            return rest
        return left - left % self.block_size


class WaitingQueue(Protocol):
    """The waiting requests; `head()` is the only one that may be admitted next."""

    def append(self, obj: Any) -> None: ...
    def head(self) -> Any | None: ...
    def pop_head(self) -> Any: ...
    def remove(self, obj: Any) -> None: ...
    def in_order(self) -> list[Any]: ...
    def __len__(self) -> int: ...


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class FCFSQueue:
    """Strict first come, first served: the head is the oldest add()."""

    def __init__(self) -> None:
        self._q: deque[Any] = deque()

    def append(self, obj: Any) -> None:
        self._q.append(obj)

    def head(self) -> Any | None:
        return self._q[0] if self._q else None

    def pop_head(self) -> Any:
        return self._q.popleft()

    def push_front(self, objs: list[Any]) -> None:
        """Put `objs` in front of the queue, in the order given (preempted requests)."""
        self._q.extendleft(reversed(objs))

    def remove(self, obj: Any) -> None:
        self._q.remove(obj)

    def in_order(self) -> list[Any]:
        """The waiting requests in queue order (head first); O(queue)."""
        return list(self._q)

    def __len__(self) -> int:
        return len(self._q)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PriorityQueue:
    """Priority with aging: the head is the least (effective priority, add order).

    effective priority = priority - floor(waited / aging_interval), lower is more urgent (as in vLLM);
    waited is counted from arrival, in steps (from the step of add()), or in seconds (clock() minus the
    request's `arrival`) when a clock is given. Without aging_interval priorities are static.

    Bound on a low-priority request's wait (aging on, steps): a request j that arrived after request r can
    be admitted before r only if floor((a_j - a_r) / I) < p_r - p_j <= p_r - p_min, i.e. if it arrived
    within (p_r - p_min) x I steps after r. So at most the requests waiting ahead of r plus those arriving
    in that window go first, whatever keeps arriving later (tests/core/test_options.py asserts it).
    """

    def __init__(self, key: Callable[[Any], tuple[float, ...]]) -> None:
        self._items: list[Any] = []
        self.key = key

    def append(self, obj: Any) -> None:
        self._items.append(obj)

    def head(self) -> Any | None:
        return min(self._items, key=self.key) if self._items else None

    def pop_head(self) -> Any:
        obj = self.head()
        self._items.remove(obj)
        return obj

    def remove(self, obj: Any) -> None:
        self._items.remove(obj)

    def in_order(self) -> list[Any]:
        """The waiting requests in queue order (most urgent first); O(queue log queue)."""
        return sorted(self._items, key=self.key)

    def __len__(self) -> int:
        return len(self._items)


class DecodeSelection(Protocol):
    """Which ready decodes run when their tokens exceed the step's budget; returns indices in batch order."""

    def select(self, costs: Sequence[int], budget: int, order: Sequence[int] | None) -> list[int]: ...


def _take(indices: Sequence[int], costs: Sequence[int], budget: int) -> list[int]:
    out, used = [], 0
    for i in indices:
        if used + costs[i] > budget:
            break
        out.append(i)
        used += costs[i]
    return out


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class OldestFirst:
    """The oldest admitted decodes (or, under the priority policy, the most urgent) run; the rest skip."""

    def select(self, costs: Sequence[int], budget: int, order: Sequence[int] | None) -> list[int]:
        return _take(order if order is not None else range(len(costs)), costs, budget)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Rotate:
    """The start index advances by the number served each step, so the skipped decodes differ.

    Fairness: over k consecutive steps with the same R ready decodes of which S fit each step, each is
    served at least floor(k * S / R) - 1 times (the window covers k*S consecutive positions of the cycle).
    """

    def __init__(self) -> None:
        self.start = 0

    def select(self, costs: Sequence[int], budget: int, order: Sequence[int] | None) -> list[int]:
        n = len(costs)
        first = self.start % n
        chosen = _take([(first + j) % n for j in range(n)], costs, budget)
        self.start = first + len(chosen)
        return sorted(chosen)


def build_policies(
    block_size: object,
    policy: object,
    aging_interval: object,
    clock: Callable[[], float] | None,
    decode_overflow: object,
    num_spec_tokens: object,
    clock_needed: bool = False,
) -> tuple[Chunking, str, DecodeSelection]:
    """Validate the option keywords of Scheduler(...) and build the chunking and selection hooks.

    Args:
        clock_needed: a clock is wanted for another option (max_queue_time_s), so it is allowed under
            policy="fcfs" too.

    Returns:
        (chunking, policy, decode selection); the waiting queue is built by the scheduler, which owns
        the key its entries are ordered by.

    Raises:
        InvalidConfig: an unknown policy or decode_overflow, a block_size or aging_interval that is not
            positive, a negative or non-integer num_spec_tokens, a clock that is not callable, or
            decode_overflow="rotate" with policy="priority" (under priorities the most urgent run).
    """
    chunking: Chunking = ExactChunks() if block_size is None else BlockAlignedChunks(block_size)
    if policy not in ("fcfs", "priority"):
        raise InvalidConfig(f"policy must be 'fcfs' or 'priority', got {policy!r}")
    if aging_interval is not None and (
        isinstance(aging_interval, bool)
        or not isinstance(aging_interval, int | float)
        or not math.isfinite(aging_interval)
        or aging_interval <= 0
    ):
        raise InvalidConfig(f"aging_interval must be a number > 0, got {aging_interval!r}")
    if policy == "fcfs" and (aging_interval is not None or (clock is not None and not clock_needed)):
        raise InvalidConfig(
            f"aging_interval ({aging_interval!r}) and clock apply to policy='priority' only (a clock also to "
            "max_queue_time_s); got policy='fcfs'"
        )
    if clock is not None and not callable(clock):
        raise InvalidConfig(f"clock must be callable, got {clock!r}")
    if isinstance(num_spec_tokens, bool) or not isinstance(num_spec_tokens, int) or num_spec_tokens < 0:
        raise InvalidConfig(f"num_spec_tokens must be an integer >= 0, got {num_spec_tokens!r}")
    if decode_overflow == "oldest":
        selection: DecodeSelection = OldestFirst()
    elif decode_overflow == "rotate":
        if policy == "priority":
            raise InvalidConfig(
                "decode_overflow='rotate' applies to policy='fcfs'; under 'priority' the most urgent run"
            )
        selection = Rotate()
    else:
        raise InvalidConfig(f"decode_overflow must be 'oldest' or 'rotate', got {decode_overflow!r}")
    return chunking, policy, selection


def check_partial_prefills(
    max_num_partial_prefills: object,
    max_long_partial_prefills: object,
    long_prefill_token_threshold: object,
    block_size: int | None,
) -> tuple[int, int, int | None]:
    """Validate the partial-prefill options of Scheduler(...) and fill in their defaults.

    K = max_num_partial_prefills prompts may be partially prefilled at once, at most L =
    max_long_partial_prefills of them long, where a prompt is long when its tokens still to compute
    exceed T = long_prefill_token_threshold. K = 1 is the contract (one partial prefill); then L and
    T must be left unset. With K > 1, L defaults to 1 (vLLM's default) and T is required: the core
    has no context length, so the simulator and the engine pass 4% of the model's context length
    (vLLM's default).

    Args:
        max_num_partial_prefills: K, an integer >= 1.
        max_long_partial_prefills: L, None or an integer from 1 to K.
        long_prefill_token_threshold: T in tokens, None or an integer >= 1 (>= block_size when
            chunks are block-aligned, so that a long prompt's chunk is never 0 tokens).
        block_size: the chunk alignment in tokens, or None.

    Returns:
        (K, L, T), with L = K = 1 and T = None for the contract.

    Raises:
        InvalidConfig: a value out of range, T missing with K > 1, or L or T given with K = 1.
    """
    k = check_positive_int("max_num_partial_prefills", max_num_partial_prefills)
    if k == 1:
        long_given = max_long_partial_prefills is not None and (
            isinstance(max_long_partial_prefills, bool) or max_long_partial_prefills != 1)
        if long_given or long_prefill_token_threshold is not None:
            raise InvalidConfig(
                "max_long_partial_prefills and long_prefill_token_threshold apply when "
                f"max_num_partial_prefills > 1; got {max_long_partial_prefills!r} and "
                f"{long_prefill_token_threshold!r} with max_num_partial_prefills=1"
            )
        return 1, 1, None
    lng = 1 if max_long_partial_prefills is None else check_positive_int(
        "max_long_partial_prefills", max_long_partial_prefills)
    if lng > k:
        raise InvalidConfig(
            f"max_long_partial_prefills ({lng}) must be <= max_num_partial_prefills ({k})"
        )
    if long_prefill_token_threshold is None:
        raise InvalidConfig(
            f"max_num_partial_prefills={k} needs long_prefill_token_threshold (tokens; the simulator "
            "and the engine default it to 4% of the context length), got None"
        )
    t = check_positive_int("long_prefill_token_threshold", long_prefill_token_threshold)
    if block_size is not None and t < block_size:
        raise InvalidConfig(
            f"long_prefill_token_threshold ({t}) must be >= block_size ({block_size}) when chunks are block-aligned"
        )
    return k, lng, t
