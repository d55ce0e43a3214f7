"""A KV manager on the core's seam (stallfree.core.kv.KVManager) whose blocks are vLLM's: admission and growth
are vLLM's KVCacheManager.get_computed_blocks / allocate_slots (prefix-cache hits, the watermark and
scheduler_reserve_full_isl included), a preemption is vLLM's own preemption path.

Imports allowed: the standard library, stallfree.core and vLLM 0.33 or 0.34 (through the objects it is handed, and
stallfree.integrations.vllm._compat for what differs between them).

The core's scheduler decides who runs and who is preempted; this manager only asks vLLM's KV cache manager
whether the blocks are there. Counts are tokens unless they say blocks. A vLLM request's
`num_computed_tokens` is the core's "tokens in its KV" at every call (vLLM advances it when a step is
scheduled, as the core's complete() does), so growth to `tokens` tokens is allocate_slots of
`tokens - num_computed_tokens` new ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from stallfree.core.errors import RequestRejected
from stallfree.core.kv import NO_HIT, NO_TRANSFERS, PrefixCacheStats, PrefixCacheView, Transfers
from stallfree.core.request import Request
from stallfree.integrations.vllm import _compat

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = ["Hit", "KVHost", "VLLMKV"]


class Hit(NamedTuple):
    """A request's cached prefix as vLLM sees it at admission (counts in tokens).

    Attributes:
        blocks: vLLM's KVCacheBlocks of the local hit (None: no local blocks to adopt).
        num_local: tokens in vLLM's prefix cache (a whole number of blocks, or vLLM's capped partial block).
        num_external: tokens the KV connector loads after them.
        queries: tokens the connector was asked about (num_tokens - num_local; 0 without a connector), for
            its hit statistics.
        load_async: the connector loads the external tokens asynchronously (vLLM's WAITING_FOR_REMOTE_KVS).
        resident: tokens already in the request's own blocks (an asynchronous load that finished); the other
            counts are then 0.
    """

    blocks: Any
    num_local: int
    num_external: int
    queries: int
    load_async: bool
    resident: int = 0


NO_EXTERNAL = Hit(None, 0, 0, 0, False)


class KVHost(Protocol):
    """What the manager needs of the vLLM scheduler it serves (the adapter's Scheduler classes)."""

    requests: dict[Any, Any]
    kv_cache_manager: Any
    num_lookahead_tokens: int
    scheduler_reserve_full_isl: bool
    aux_output_connector: Any
    connector: Any
    connector_prefix_cache_stats: Any

    def _stallfree_admitted(self, request: Any, num_local: int, num_external: int) -> None:
        """A waiting or preempted request was admitted with `num_local` tokens from vLLM's prefix cache and
        `num_external` loaded by the KV connector (synchronously, in the step it is scheduled); both are 0 for a
        request already in its own blocks (vLLM's num_computed_tokens > 0: an asynchronous load finished)."""

    def _stallfree_preempted(self, request: Any) -> None:
        """The core preempted a running request: take it through vLLM's preemption path."""

    def _get_local_prefix_cache_hit(self, request: Any, max_cache_hit_length: int | None) -> Any:
        """vLLM's local prefix-cache lookup: (blocks, tokens, shared-prefix boundary, hybrid hit diverged)."""

    def _stallfree_encoder_tokens(self, request: Any) -> int:
        """Encoder tokens of the chunk last capped, for an encoder-decoder model's cross-attention blocks."""

    def _stallfree_chunk_taken(self, request: Any) -> None:
        """The KV of the prompt chunk last capped (schedule(chunk_cap=...)) was given: its encoder inputs run."""


class VLLMKV:
    """The core's KV manager over vLLM's KVCacheManager (any KV cache groups: vLLM allocates and frees each
    group's blocks; the counts here are of its shared block pool).

    Args:
        host: the vLLM scheduler whose requests and KV cache manager are used.
        block_size: tokens per KV block (vLLM's scheduler block size).
        num_blocks: usable KV blocks (vLLM's pool less its null block).

    Phases: during the core's schedule() (`in_schedule` True) a free() is a preemption and goes through the
    host's preemption path; any other free() (a finish the core counted, or a stop or abort that vLLM
    detected and already freed) leaves vLLM's blocks to vLLM, which frees them when it finishes the request.

    can_admit() allocates when it answers True (vLLM has no side-effect-free "would this fit" for a prefix
    hit); the core always admits right after a True, so this changes no behaviour.
    """

    has_block_ids = True

    def __init__(self, host: KVHost, block_size: int, num_blocks: int) -> None:
        self.host = host
        self.kvm = host.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_total = num_blocks * block_size
        self.prefix_stats = PrefixCacheStats()
        #: The running decodes by rid (each grows through allocate_slots every step, as in vLLM).
        self.decodes: dict[Hashable, LiveRequest] = {}
        #: New blocks per request in the step being planned (vLLM's KVCacheBlocks, summed).
        self.new_blocks: dict[Any, Any] = {}
        self.in_schedule = False
        #: The last lookup: (rid, its Hit), or (rid, None) when the request is not admitted this step (its
        #: connector load is asynchronous, or the connector cannot tell its hit yet).
        self._hit: tuple[Hashable, Hit | None] | None = None
        #: Whether a request admitted in this step loads KV through the connector (vLLM's has_sync_kv_loads).
        self.has_sync_kv_loads = False
        #: The connector's get_num_new_matched_tokens answers in this step, by (rid, local tokens asked with).
        self._asked: dict[tuple[Hashable, int], tuple[int | None, bool]] = {}

    # ------------------------------------------------------------------ figures

    @property
    def kv_free(self) -> int:
        """Free KV in tokens (vLLM's free blocks, evictable cached ones included, x block_size)."""
        return int(self.pool.get_num_free_blocks()) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """vLLM's free blocks (evictable cached blocks included)."""
        return int(self.pool.get_num_free_blocks())

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests: num_blocks - free."""
        return self.num_blocks - self.num_free_blocks

    num_evictable_blocks = 0
    num_evictions = 0

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: ceil((prompt_len + max_new - 1) / block_size)."""
        return -(-(req.prompt_len + req.max_new - 1) // self.block_size)

    def kv_needed_for(self, req: Request) -> int:
        """blocks_needed(req) x block_size, tokens."""
        return self.blocks_needed(req) * self.block_size

    def check_fits(self, req: Request) -> int:
        """Return 0 if `req`'s prompt can ever fit in vLLM's pool.

        Only the prompt is checked, as vLLM admits a request whose output may outgrow the cache (vLLM's
        engine refuses at start a cache that cannot hold max_model_len tokens, so in serving this never
        rejects; a request that outgrows a smaller cache is preempted and waits, as under vLLM's scheduler).

        Raises:
            RequestRejected: ceil(prompt_len / block_size) > num_blocks; the message gives the numbers.
        """
        need = -(-req.prompt_len // self.block_size)
        if need > self.num_blocks:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: its prompt needs ceil(prompt_len / block_size) = "
                f"ceil({req.prompt_len} / {self.block_size}) = {need} blocks > the {self.num_blocks} KV blocks "
                "of vLLM's cache"
            )
        return 0

    def cached_prefix_len(self, req: Request) -> int:
        """0: vLLM's prefix cache is asked at admission (lookup), not for routing."""
        return 0

    # ------------------------------------------------------------------ admission

    def external_hit(self, request: Any) -> Hit | None:
        """vLLM's cached prefix of a request that holds no KV yet, as vLLM's scheduler works it out at admission:
        get_computed_blocks (capped by vLLM at num_tokens - 1, and by the auxiliary-output connector), then,
        with a KV connector, its get_num_new_matched_tokens beyond the block-aligned local hit (a remote hit
        longer than a local partial block replaces that block; a shorter one is not loaded; the
        auxiliary-output cap and vLLM's bound on reading external KV apply).

        The connector is asked once per request and step (its answer is kept until `new_step()`), as vLLM
        asks it once each time its admission loop reaches the request.

        Returns:
            The Hit (tokens), or None while the connector cannot tell its hit yet (it answered None).
        """
        aux = self.host.aux_output_connector
        cap = aux.max_cache_hit(request) if aux is not None else None
        blocks, num_local, boundary, diverged = self.host._get_local_prefix_cache_hit(request, cap)
        request.shared_prefix_boundary = boundary
        num_ext = queries = 0
        load_async = False
        connector = self.host.connector
        if connector is not None:
            tail = num_local % self.block_size
            aligned = num_local - tail
            key = (request.request_id, aligned)
            answer = self._asked.get(key)
            if answer is None:
                answer = self._asked[key] = connector.get_num_new_matched_tokens(request, aligned)
            got, load_async = answer
            if _compat.skips_external_kv(request):
                got, load_async = 0, False
            if got is None:
                return None
            if tail and got > tail:
                blocks = self.kvm.truncate_computed_blocks(blocks, aligned)
                num_local, num_ext = aligned, got
            elif not tail:
                num_ext = got
            if aux is not None:
                num_ext = aux.cap_external_hit(request, num_local, num_ext)
            if diverged and num_ext == 0:
                # A hybrid model's deeper full-attention hit has no Mamba state without external tokens: the
                # hit every group agrees on, as vLLM.
                blocks, num_local, request.shared_prefix_boundary = self.kvm.get_computed_blocks(request, cap)
            queries = request.num_tokens - num_local
        return Hit(blocks, num_local, num_ext, queries, bool(load_async) and num_ext > 0)

    def new_step(self) -> None:
        """A step is being planned: forget the last step's new blocks, sync-load flag and connector answers."""
        self.new_blocks = {}
        self.has_sync_kv_loads = False
        self._asked = {}

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """The request's hit in tokens (the handle is empty; the blocks are kept for can_admit).

        A request that already holds KV (an asynchronous connector load that finished, vLLM's
        num_computed_tokens > 0) hits those tokens, in its own blocks. Otherwise the hit is external_hit's
        local + external tokens. A request whose connector load is asynchronous, or whose hit the connector
        cannot tell yet, is not admitted (can_admit says False): the host starts the load
        (`_stallfree_start_loads`) once the core's admission stopped at it, or asks again next step.
        """
        request = self.host.requests[rec.rid]
        resident = request.num_computed_tokens
        if resident:
            self._hit = (rec.rid, Hit(None, 0, 0, 0, False, resident))
            return resident, ()
        hit = self.external_hit(request)
        if hit is None or hit.load_async:
            self._hit = (rec.rid, None)
            return NO_HIT
        self._hit = (rec.rid, hit)
        return hit.num_local + hit.num_external, ()

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int]) -> bool:
        """allocate_slots for the cached prefix (local and external; none for a request in its own blocks) and
        a first chunk of `first_chunk` tokens, with vLLM's watermark (when something runs) and
        scheduler_reserve_full_isl; True when vLLM gave the blocks. False, allocating nothing, for a request
        whose connector load is asynchronous or whose hit the connector cannot tell yet."""
        request = self.host.requests[rec.rid]
        hit = self._hit[1] if self._hit is not None and self._hit[0] == rec.rid else NO_EXTERNAL
        if hit is None:
            return False
        new = self.kvm.allocate_slots(
            request,
            first_chunk,
            num_new_computed_tokens=hit.num_local,
            new_computed_blocks=hit.blocks,
            num_lookahead_tokens=self.host.num_lookahead_tokens,
            num_external_computed_tokens=hit.num_external,
            num_encoder_tokens=self.host._stallfree_encoder_tokens(request),
            full_sequence_must_fit=self.host.scheduler_reserve_full_isl,
            has_scheduled_reqs=num_running > 0,
        )
        return new is not None

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int]) -> None:
        """The blocks were given by can_admit: tell the KV connector (update_state_after_alloc, its hit
        statistics; a request in its own blocks was counted when its load started), move the vLLM request to
        running, count the prefix lookup."""
        request = self.host.requests[rec.rid]
        hit = self._hit[1] if self._hit is not None and self._hit[0] == rec.rid else None
        hit = hit or NO_EXTERNAL
        self._hit = None
        num_local, num_ext = hit.num_local, hit.num_external
        self.prefix_stats.count(rec, num_local + num_ext + hit.resident)
        connector = self.host.connector
        if connector is not None:
            connector.update_state_after_alloc(request, self.kvm.get_blocks(request.request_id), num_ext)
            stats = self.host.connector_prefix_cache_stats
            if stats is not None and hit.queries:
                preempted = request.num_preemptions > 0
                stats.record(
                    num_tokens=hit.queries, num_hits=num_ext, preempted=preempted,
                    hits_by_source=(
                        connector.get_external_cache_hit_sources(request, num_ext)
                        if num_ext and not preempted else None
                    ),
                )
            if num_ext:
                self.has_sync_kv_loads = True
        self.host._stallfree_admitted(request, num_local, num_ext)
        self.host._stallfree_chunk_taken(request)

    # ------------------------------------------------------------------ growth

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """Every decode: each is grown through allocate_slots, which also caches its full blocks."""
        return list(self.decodes.values())

    def step_transfers(self) -> Transfers:
        """NO_TRANSFERS: vLLM's own connector moves KV between tiers, not stallfree's plan."""
        return NO_TRANSFERS

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """allocate_slots for the tokens beyond vLLM's num_computed_tokens; False when vLLM has too few blocks.
        The encoder inputs of a prompt chunk whose cap counted them run once its blocks are given."""
        request = self.host.requests[rec.rid]
        num_new = tokens - request.num_computed_tokens
        if num_new <= 0:
            return True
        new = self.kvm.allocate_slots(request, num_new, num_lookahead_tokens=self.host.num_lookahead_tokens)
        if new is None:
            return False
        rid = request.request_id
        got = self.new_blocks.get(rid)
        self.new_blocks[rid] = new if got is None else got + new
        self.host._stallfree_chunk_taken(request)
        return True

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """Nothing: allocate_slots caches the full blocks of the tokens it is given."""

    def moved(self, rec: LiveRequest, step: int) -> None:
        """Nothing: vLLM's blocks follow num_computed_tokens."""

    def start_decode(self, rec: LiveRequest) -> None:
        """`rec` joins the decodes."""
        self.decodes[rec.rid] = rec

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Nothing: rejected draft tokens leave vLLM's blocks allocated, as vLLM's own scheduler does."""

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """A preemption (during schedule): vLLM's preemption path frees the blocks. Otherwise vLLM frees them
        when it finishes the request."""
        self.decodes.pop(rec.rid, None)
        if self.in_schedule:
            request = self.host.requests[rec.rid]
            self.new_blocks.pop(request.request_id, None)
            self.host._stallfree_preempted(request)

    # ------------------------------------------------------------------ reads

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """vLLM's block ids of the request (its first KV cache group)."""
        ids = self.kvm.get_block_ids(rec.rid)
        return tuple(ids[0]) if ids else ()

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in vLLM's free queue (evictable cached blocks included)."""
        queue = self.pool.free_block_queue
        return tuple(b.block_id for b in queue.get_all_free_blocks())

    def cache_view(self) -> PrefixCacheView | None:
        """None: the prefix cache is vLLM's."""
        return None
