"""What a caller hands the scheduler (Request) and the states a request goes through.

Imports allowed: the standard library only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from stallfree.core.errors import RequestRejected, check_positive_int

__all__ = ["DEFAULT_TENANT", "FinishReason", "Request", "RequestState", "RequestStatus"]

#: The tenant of a request whose `tenant` is None.
DEFAULT_TENANT = "default"
#: The longest tenant name (characters): names label metrics and log lines.
MAX_TENANT_CHARS = 128


class RequestStatus(enum.Enum):
    """Where a request is in its life. FINISHED and ABORTED are terminal."""

    WAITING = enum.auto()
    PREFILLING = enum.auto()
    DECODING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()
    ABORTED = enum.auto()


class FinishReason(enum.StrEnum):
    """Why a request ended, with OpenAI's strings: "length" (max_new reached), "stop" (EOS or a
    stop string, through complete(stopped=...)), "abort" (abort()), "timeout" (it waited in the queue
    longer than SchedulerConfig.max_queue_time_s allows, never admitted; listed in the plan's `timed_out`)."""

    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request, as the scheduler sees it: lengths in tokens, never token ids.

    Args:
        rid: any hashable id, unique among live requests (it may be reused once the request finished).
        prompt_len: prompt length in tokens, >= 1.
        max_new: the most tokens to generate, >= 1; the reservation scheduler reserves KV for
            prompt_len + max_new tokens at admission.
        priority: lower is more urgent (as in vLLM); used only by the priority policy.
        arrival: arrival time in seconds (simulated or wall clock); informational for the core.
        block_hashes: None, or the prompt's identity for prefix caching: one hashable per full
            block of block_size prompt tokens (prompt_len // block_size of them), chained so that a
            block's hash depends on every token before it (stallfree.core.prefix_cache.hash_blocks).
            Stored as a tuple. Only a Scheduler with enable_prefix_caching=True accepts them; it
            checks the length against its block_size at add(). It may go on past the prompt with
            the hashes of the output's blocks, up to (prompt_len + max_new - 1) // block_size in
            all, when the output is known in advance (a simulated conversation's answer, which its
            next turn resends): those blocks are cached when the request finishes, each once its
            every token's KV is computed.
        lora: None (the base model), or the name of the LoRA adapter the request runs with: any
            hashable value equal to itself (a str, or vLLM's integer lora_int_id); "" is the base
            model too, as in a trace's empty lora column (stored as None). A Scheduler with
            max_loras runs at most that many distinct adapters at once (stallfree.core.lora);
            without it the name is carried and nothing changes.
        tenant: None (the tenant "default") or the name of the client the request is served for, a
            non-empty str of at most 128 characters; read only under SchedulerConfig(fairness="vtc"),
            which shares admission fairly between tenants, and by max_queue_time_s given per tenant.

    Raises:
        RequestRejected: prompt_len or max_new is not an integer >= 1 (bools included), priority
            is not an integer, rid is unhashable or not equal to itself (NaN), or arrival is not a
            finite number, or block_hashes is not None nor a sequence of hashables (a str or bytes
            is refused), or lora is unhashable, not equal to itself or a bool, or tenant is neither
            None nor a non-empty str of at most 128 characters; the message names the field and the value.
    """

    rid: Hashable
    prompt_len: int
    max_new: int
    priority: int = 0
    arrival: float = 0.0
    block_hashes: tuple[Hashable, ...] | None = None
    lora: Hashable | None = None
    tenant: str | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> Request:
        return self  # frozen and never mutated: a copy of a scheduler shares its requests

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (the constructor does; a scheduler's add() does again, for a Request whose
        fields were set around the constructor, as a deserializer may do).

        Raises:
            RequestRejected: as the constructor; the message names the field and the value.
        """
        arrival = self.arrival
        if (type(self.rid) is int and type(self.prompt_len) is int and self.prompt_len >= 1
                and type(self.max_new) is int and self.max_new >= 1 and type(self.priority) is int
                and type(arrival) is float and math.isfinite(arrival) and self.block_hashes is None
                and self.lora is None and self.tenant is None):
            return  # the common request, every check below passed at a glance (an int rid hashes, equals itself)
        check_positive_int("prompt_len", self.prompt_len, RequestRejected)
        check_positive_int("max_new", self.max_new, RequestRejected)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise RequestRejected(f"priority must be an integer, got {self.priority!r}")
        try:
            hash(self.rid)
        except TypeError:
            raise RequestRejected(f"rid must be hashable, got {self.rid!r}") from None
        if self.rid != self.rid:  # NaN: it could never be found again by its rid
            raise RequestRejected(f"rid must equal itself, got {self.rid!r}")
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not math.isfinite(arrival):
            raise RequestRejected(f"arrival must be a finite number of seconds, got {arrival!r}")
        hashes = self.block_hashes
        if hashes is not None:
            if isinstance(hashes, str | bytes) or not isinstance(hashes, Sequence):
                raise RequestRejected(
                    f"block_hashes must be None or a sequence of block hashes, got {type(hashes).__name__}"
                )
            try:
                for h in hashes:
                    hash(h)
            except TypeError:
                raise RequestRejected(f"block_hashes must hold hashable values, got {h!r}") from None
            if not isinstance(hashes, tuple):
                object.__setattr__(self, "block_hashes", tuple(hashes))
        if self.lora is not None:
            _check_lora(self.lora)
            if self.lora == "":
                object.__setattr__(self, "lora", None)
        tenant = self.tenant
        if tenant is not None and (not isinstance(tenant, str) or not 1 <= len(tenant) <= MAX_TENANT_CHARS):
            raise RequestRejected(
                f"tenant must be None or a non-empty str of at most {MAX_TENANT_CHARS} characters, got {tenant!r}")

    @property
    def tenant_name(self) -> str:
        """The tenant the request is served for: `tenant`, or "default" when it is None."""
        return DEFAULT_TENANT if self.tenant is None else self.tenant


def _check_lora(lora: object) -> None:
    """Refuse an adapter name the scheduler could not count: unhashable, NaN or a bool."""
    try:
        hash(lora)
    except TypeError:
        raise RequestRejected(f"lora must be None or a hashable adapter name, got {lora!r}") from None
    if isinstance(lora, bool) or lora != lora:
        raise RequestRejected(f"lora must be None (the base model) or an adapter name, got {lora!r}")


@dataclass(frozen=True, slots=True)
class RequestState:
    """A snapshot of one live request, from Scheduler.request_state(rid).

    Units: counts are tokens; steps are scheduler step numbers (from 0), None until it happened;
    num_lora_passes counts steps in which a later request was admitted past it because its LoRA adapter
    could not join (max_loras; core/lora.py), at most max_lora_passes.
    """

    rid: Hashable
    status: RequestStatus
    num_prefilled: int
    num_generated: int
    admitted_step: int | None
    first_token_step: int | None
    num_preemptions: int = 0
    num_lora_passes: int = 0

    @property
    def num_output_tokens(self) -> int:
        """vLLM's name of num_generated: tokens generated so far."""
        return self.num_generated
