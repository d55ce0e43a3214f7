"""The paged KV policy: KV blocks taken as tokens are scheduled, admission by a free-block watermark,
optional prefix caching.

Imports allowed: the standard library and stallfree.core only.

Source: paged KV cache with preemption by recompute (PagedAttention / vLLM, Kwon et al., SOSP'23); the
free-block watermark at admission (vLLM's and Sarathi-Serve's block managers).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import RequestRejected
from stallfree.core.kv.options import check_watermark
from stallfree.core.kv.pool import BlockPool, CachingBlockPool, blocks_for_tokens
from stallfree.core.kv.pooled import PooledKV, reject_hashes
from stallfree.core.kv.protocol import NO_HIT, PrefixCacheStats
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = ["PagedKV"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PagedKV(PooledKV):
    """The paged KV policy: blocks taken as tokens are scheduled, admission by a free-block watermark.

    A running request holds ceil(tokens in its KV / block_size) blocks (plus, while its step is in
    flight, those of the tokens scheduled in it). Decodes are filed by the step residue at which their
    next token starts a block: at step k the decodes of bucket k % block_size each need one, and are
    served by one promise of that many blocks; each table gets its ids when it is read
    (`materialize`). A decode whose progress is not one token a step (a skipped decode, speculative
    tokens) is re-filed by the scheduler through `refile`.

    Args:
        num_blocks: KV blocks, >= 1.
        block_size: tokens per block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.
        enable_prefix_caching: keep computed prompt blocks for reuse (a CachingBlockPool); a
            request's longest cached prefix is then pinned at admission (`lookup`, `admit`).

    Raises:
        InvalidConfig: an argument is out of range; the message names it.
    """

    pool: BlockPool

    def __init__(self, num_blocks: object, block_size: object, watermark: object,
                 enable_prefix_caching: object = False) -> None:
        # The sizes are read as objects and checked by the pool (a compiled build would turn True into 1).
        self.cache: CachingBlockPool | None = None
        if enable_prefix_caching:
            self.pool = self.cache = CachingBlockPool(num_blocks, block_size)
        else:
            self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks = self.pool.num_blocks
        self.block_size = block_size = self.pool.block_size
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = math.floor(self.watermark * num_blocks)
        self.kv_total = num_blocks * block_size
        self.buckets: dict[int, dict[Hashable, LiveRequest]] = {}
        self.has_block_ids = True
        self.prefix_stats = PrefixCacheStats()

    def kv_needed_for(self, req: Request) -> int:
        """The most KV `req` ever holds, tokens: blocks_needed(req) x block_size."""
        return self.blocks_needed(req) * self.block_size

    def cached_prefix_len(self, req: Request) -> int:
        """Prefix caching: tokens of `req`'s prompt whose blocks are cached now, capped as `lookup`
        caps a hit (at most prompt_len - 1 tokens, in whole blocks); 0 without caching or
        block_hashes. O(blocks of the prompt); nothing is pinned and no block's recency changes."""
        hashes = req.block_hashes
        if self.cache is None or not hashes:
            return 0
        bs = self.block_size
        return len(self.cache.lookup(hashes, (req.prompt_len - 1) // bs)) * bs

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: ceil((prompt_len + max_new - 1) / block_size).

        The last sampled token is never fed back, so its KV is never computed.
        """
        return blocks_for_tokens(req.prompt_len + req.max_new - 1, self.block_size)

    def check_fits(self, req: Request) -> int:
        """Return 0 (nothing is reserved) if `req` fits.

        Raises:
            RequestRejected: blocks_needed(req) is more than num_blocks; or `req` has block_hashes
                without prefix caching, or not one per full block of its prompt; the message gives
                the numbers.
        """
        hashes = req.block_hashes
        if hashes is not None:
            if self.cache is None:
                reject_hashes(req, "paged")
            want = req.prompt_len // self.block_size
            most = (req.prompt_len + req.max_new - 1) // self.block_size
            if not want <= len(hashes) <= most:
                raise RequestRejected(
                    f"request {req.rid!r}: block_hashes has {len(hashes)} hashes, expected one per full "
                    f"block of the prompt: prompt_len // block_size = {req.prompt_len} // "
                    f"{self.block_size} = {want} (up to (prompt_len + max_new - 1) // block_size = {most} "
                    "with the output's blocks)"
                )
        need = self.blocks_needed(req)
        if need > self.num_blocks:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: ceil((prompt_len + max_new - 1) / block_size) = "
                f"ceil(({req.prompt_len} + {req.max_new} - 1) / {self.block_size}) = {need} blocks "
                f"> num_blocks = {self.num_blocks}"
            )
        return 0

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int] = ()) -> bool:
        """The blocks of the first chunk are free and the watermark stays free (waived when nothing
        runs). A preempted request needs the blocks of its whole recompute (prompt + generated), so
        that it is not readmitted only to be preempted again (B21's thrashing).

        With prefix caching, `hits` are the cached blocks of its prefix (from `lookup`); the first
        chunk then starts after them, only the blocks to allocate count, plus the hit blocks that
        are evictable now (pinning them takes them out of the free count)."""
        bs = self.block_size
        h = len(hits)
        want = -(-rec.target // bs) if rec.num_preemptions else -(-(h * bs + first_chunk) // bs)
        want -= h
        if h:
            assert self.cache is not None
            want += self.cache.num_evictable_among(hits)
        free = self.pool.num_free
        return want <= free and not (num_running and free - want < self.watermark_blocks)

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int] = ()) -> None:
        """Give `rec` its hit blocks (pinned) and the blocks of its first chunk after them; with
        prefix caching, count the lookup in prefix_stats."""
        h = len(hits)
        if h:
            assert self.cache is not None
            self.cache.pin(rec.block_table, hits)
        self.pool.allocate(rec.block_table, -(-(h * self.block_size + first_chunk) // self.block_size) - h)
        if self.cache is not None:
            self.prefix_stats.count(rec, h * self.block_size)

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """Prefix caching: (tokens, blocks) of `rec`'s longest cached prompt prefix, capped at
        prompt_len - 1 tokens, so that at least the prompt's last token (and so the episode's last
        token, which samples) is computed; NO_HIT without caching or block_hashes."""
        hashes = rec.req.block_hashes
        if not hashes or self.cache is None:
            return NO_HIT
        hits = self.cache.lookup(hashes, (rec.num_prompt_tokens - 1) // self.block_size)
        return len(hits) * self.block_size, hits

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """Promise, in one count, a block to each decode whose token of step `step` starts one (the
        bucket of step % block_size) and return (); when too few are free, promise nothing and
        return those decodes."""
        bucket = self.buckets.get(step % self.block_size)
        if bucket and not self.pool.try_promise(len(bucket)):
            return list(bucket.values())
        return ()

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """Prefix caching: cache the full prompt blocks that tokens [start, end) completed (register)."""
        if self.cache is not None:
            self.register(rec, start, end)

    def moved(self, rec: LiveRequest, step: int) -> None:
        """A decode skipped a step or took speculative tokens: claim the ids promised to it for the
        tokens now in its KV (offset + step), and file it under its new residue."""
        self.materialize(rec, step, False)
        self.refile(rec)

    def start_decode(self, rec: LiveRequest) -> None:
        """File a new decode by the residue at which its next token starts a block (file_decode)."""
        self.file_decode(rec)

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """`rec`'s table, a decode's promised blocks claimed so that it covers `tokens` tokens."""
        if rec.bucket >= 0:
            missing = -(-tokens // self.block_size) - len(rec.block_table)
            if missing > 0:
                self.pool.claim(rec.block_table, missing)
        return tuple(rec.block_table)

    def peek_table(self, rec: LiveRequest, tokens: int) -> tuple[tuple[int, ...], int]:
        """`rec`'s table as it is, and how many blocks promised to it (to cover `tokens` tokens) have no
        id yet; a pure read: unlike `block_table` it claims nothing, so no cached block is evicted."""
        missing = -(-tokens // self.block_size) - len(rec.block_table) if rec.bucket >= 0 else 0
        return tuple(rec.block_table), max(missing, 0)

    def register(self, rec: LiveRequest, start: int, end: int) -> None:
        """Prefix caching: a chunk of `rec` computed its tokens [start, end); cache the full prompt
        blocks it completed."""
        hashes = rec.req.block_hashes
        if hashes and self.cache is not None:
            bs = self.block_size
            last = min(len(hashes), end // bs)
            first = start // bs
            if last > first:
                self.cache.register(rec.block_table, hashes, first, last)

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """Give `rec` the blocks to hold `tokens` tokens in step `step` (a decode first claims the
        blocks promised to it for the tokens already in its KV); False (nothing more changes) when
        too few are free."""
        if rec.bucket >= 0:
            self.materialize(rec, step, False)
        need = -(-tokens // self.block_size) - len(rec.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        self.pool.allocate(rec.block_table, need)
        return True

    def _register_output(self, rec: LiveRequest, step: int, in_flight: bool, unclaimed: int) -> int:
        """Cache the full blocks of `rec`'s generated tokens that its block hashes name (hashes past the
        prompt's full blocks: a conversation's next turn resends this output as its history), as vLLM
        caches a request's decode blocks; return the promised blocks still unclaimed (0: claimed here).

        Only blocks whose every token's KV is computed are cached: the decode's tokens in KV are
        offset + step (the last sampled token is never fed back), less the token of a plan in flight.
        """
        hashes = rec.req.block_hashes
        assert hashes is not None and self.cache is not None
        if unclaimed:
            self.pool.claim(rec.block_table, unclaimed)
        bs = self.block_size
        computed = rec.offset + step
        last = min(len(hashes), computed // bs, len(rec.block_table))
        first = rec.num_prompt_tokens // bs
        if last > first:
            self.cache.register(rec.block_table, hashes, first, last)
        return 0

    def file_decode(self, rec: LiveRequest) -> None:
        """File a new decode under the residue at which its next token starts a block."""
        rec.bucket = -rec.offset % self.block_size
        self.buckets.setdefault(rec.bucket, {})[rec.rid] = rec

    def refile(self, rec: LiveRequest) -> None:
        """Re-file a decode whose offset moved (its table must hold the ids it was promised)."""
        del self.buckets[rec.bucket][rec.rid]
        self.file_decode(rec)

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Return the blocks of `rec` beyond those that hold `tokens` tokens (rejected speculative tokens)."""
        keep = -(-tokens // self.block_size)
        if self.cache is not None:
            self.cache.release_tail(rec.block_table, keep, len(rec.req.block_hashes or ()))
        else:
            self.pool.release_tail(rec.block_table, keep)

    def unclaimed(self, rec: LiveRequest, step: int, in_flight: bool) -> int:
        """Blocks promised to a decode and not yet in its table: its table must cover the tokens in
        its KV (offset + step), plus the token of the plan in flight."""
        tokens = rec.offset + step + in_flight
        return max(0, -(-tokens // self.block_size) - len(rec.block_table))

    def materialize(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Give a decode's table the ids of the blocks promised to it."""
        if rec.bucket >= 0:
            missing = self.unclaimed(rec, step, in_flight)
            if missing:
                self.pool.claim(rec.block_table, missing)

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return every block of `rec` (and its unclaimed promises); drop it from its bucket."""
        unclaimed = 0
        if rec.bucket >= 0:
            table = rec.block_table
            unclaimed = -(-(rec.offset + step + in_flight) // self.block_size) - len(table)
            if unclaimed < 0:
                unclaimed = 0
            del self.buckets[rec.bucket][rec.rid]
            rec.bucket = -1
        if self.cache is not None:
            hashes = rec.req.block_hashes
            if hashes and len(hashes) > rec.num_prompt_tokens // self.block_size and rec.finish_step >= 0:
                unclaimed = self._register_output(rec, step, in_flight, unclaimed)
            # Only the hashed blocks may be cached: the rest is freed without a look at each.
            self.cache.release(rec.block_table, unclaimed, len(hashes or ()))
        else:
            self.pool.release(rec.block_table, unclaimed)
