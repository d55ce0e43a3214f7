"""Block hashes past the prompt: the blocks of an output known in advance are cached when the request
finishes, each once every token of it has its KV (the last sampled token never does)."""

from __future__ import annotations

import pytest

from stallfree import Request, Scheduler
from stallfree.core.errors import RequestRejected
from stallfree.core.invariants import InvariantChecker
from stallfree.core.invariants_tier import TieredInvariantChecker


def run(s: Scheduler, cpu: bool, req: Request, stop: int | None = None) -> None:
    """Run `req` to its end under the invariant checker (the tiered one with a CPU tier)."""
    c = (TieredInvariantChecker if cpu else InvariantChecker)(s)  # type: ignore[operator]
    c.add(req)
    if stop is not None:
        c.stop_after(req.rid, stop)
    while c.has_unfinished():
        c.complete(c.schedule())
    c.check_final()


def sched(cpu: bool) -> Scheduler:
    """Paged KV of 8 blocks of 16 tokens with prefix caching (and a CPU tier of 4 blocks)."""
    extra = {"cpu_kv_tokens": 64} if cpu else {}
    return Scheduler(token_budget=64, max_seqs=4, kv_tokens=128, kv_policy="paged", block_size=16,
                     enable_prefix_caching=True, **extra)


@pytest.mark.parametrize("cpu", [False, True])
@pytest.mark.parametrize(("max_new", "stop", "cached"), [(16, None, 16), (17, None, 32), (40, 16, 16), (40, 17, 32)])
def test_output_blocks_cached_once_computed(cpu: bool, max_new: int, stop: int | None, cached: int) -> None:
    """A 16-token prompt with hashes for 3 blocks: 16 + n - 1 tokens of KV after n output tokens, so the
    second block (tokens 16..31) is cached only from n = 17 on; the third never (it would need 48)."""
    s = sched(cpu)
    n = min(3, (16 + max_new - 1) // 16)
    run(s, cpu, Request(1, 16, max_new, block_hashes=tuple(range(n))), stop)
    assert s.cached_prefix_len(Request(2, 60, 2, block_hashes=(0, 1, 2))) == cached


def test_hashes_past_the_output_are_refused() -> None:
    """More hashes than (prompt_len + max_new - 1) // block_size blocks: rejected, naming both bounds."""
    s = sched(False)
    with pytest.raises(RequestRejected, match=r"expected one per full block of the prompt.*up to"):
        s.add(Request(1, 16, 16, block_hashes=(0, 1)))
    assert not s.has_unfinished()
