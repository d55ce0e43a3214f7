"""The Scheduler's face: one way to read each figure (stats()) and each option (config); the former
spellings are deprecated aliases that warn and read the same value."""

from __future__ import annotations

import pytest

from stallfree import Request, Scheduler
from stallfree.core.aliases import deprecated_aliases

# docs/DESIGN.md section 4 promises these; they are not aliases.
DESIGN_NAMES = ("add", "schedule", "complete", "abort", "kv_free", "num_waiting", "num_running", "has_unfinished",
                "request_state")


def _face() -> set[str]:
    aliases = set(deprecated_aliases(Scheduler))
    s = Scheduler(token_budget=8, max_seqs=4, kv_tokens=100)
    return {n for n in dir(Scheduler) if not n.startswith("_") and n not in aliases} | {
        n for n in vars(s) if not n.startswith("_")}


def test_the_face_has_at_most_30_members_and_every_design_name():
    """At most 30 public members (class and instance), DESIGN section 4's names among them, none an alias."""
    face = _face()
    assert len(face) <= 30, sorted(face)
    assert set(DESIGN_NAMES) <= face
    assert not set(DESIGN_NAMES) & set(deprecated_aliases(Scheduler))


def _stepped() -> Scheduler:
    """Paged with prefix caching, budget 8, 4 KV blocks of 4 tokens: two requests sharing a cached block,
    run to the end, so that hits, evictions and preemption-free counts are all nonzero or known."""
    s = Scheduler(8, 2, 16, kv_policy="paged", block_size=4, watermark=0.25, enable_prefix_caching=True,
                  max_num_partial_prefills=2, long_prefill_token_threshold=6)
    s.add(Request("a", 6, 2, block_hashes=(11,)))
    while s.has_unfinished():
        s.complete(s.schedule())
    s.add(Request("b", 6, 2, block_hashes=(11,)))
    s.complete(s.schedule())
    return s


# (alias, how the one spelling reads it, the value worked out by hand for _stepped())
CASES = [
    ("token_budget", lambda s: s.config.token_budget, 8),
    ("max_seqs", lambda s: s.config.max_seqs, 2),
    ("block_size", lambda s: s.config.block_size, 4),
    ("policy", lambda s: s.config.policy, "fcfs"),
    ("kv_policy", lambda s: s.config.kv_policy, "paged"),
    ("enable_prefix_caching", lambda s: s.config.enable_prefix_caching, True),
    ("watermark", lambda s: float(s.config.watermark), 0.25),
    ("align_chunks", lambda s: s.config.chunks_aligned, False),
    ("max_num_partial_prefills", lambda s: s.config.max_num_partial_prefills, 2),
    ("max_long_partial_prefills", lambda s: s.config.partial_prefill_limits[1], 1),
    ("long_prefill_token_threshold", lambda s: s.config.partial_prefill_limits[2], 6),
    ("num_spec_tokens", lambda s: s.config.num_spec_tokens, 0),
    # 16 tokens of KV in blocks of 4; floor(0.25 x 4) = 1 block kept free at admission.
    ("kv_total", lambda s: s.stats().kv_total, 16),
    ("num_blocks", lambda s: s.stats().num_blocks, 4),
    ("watermark_blocks", lambda s: s.stats().watermark_blocks, 1),
    # "b" holds its hit block (pinned) and the block of its last prompt token and first output: 2 used.
    ("num_used_blocks", lambda s: s.stats().num_used_blocks, 2),
    ("num_free_blocks", lambda s: s.stats().num_free_blocks, 2),
    # "a" cached its one full block; "b" found it: 4 of its 6 prompt tokens (at most prompt_len - 1 in blocks).
    ("prefix_cache_queries", lambda s: s.stats().prefix_cache_queries, 12),
    ("prefix_cache_hits", lambda s: s.stats().prefix_cache_hits, 4),
    ("num_preemptions", lambda s: s.stats().num_preemptions, 0),
    ("num_recomputed_tokens", lambda s: s.stats().num_recomputed_tokens, 0),
    ("now", lambda s: s.stats().now, 0.0),
]


@pytest.mark.parametrize(("alias", "read", "value"), CASES, ids=[c[0] for c in CASES])
def test_each_alias_warns_and_reads_what_the_one_spelling_reads(alias, read, value):
    """The alias warns (DeprecationWarning naming the new spelling) and equals the new spelling's value."""
    s = _stepped()
    assert read(s) == value
    with pytest.warns(DeprecationWarning, match=rf"Scheduler\.{alias} is deprecated.*scheduler\."):
        got = getattr(s, alias)
    assert got == value


def test_the_method_aliases_warn_and_answer_as_the_kv_manager_does():
    """blocks_needed, kv_needed, has_request and priority_key still answer, through the one spelling."""
    s = _stepped()
    req = Request("x", 9, 4)  # paged: ceil((9 + 4 - 1) / 4) = 3 blocks, 12 tokens
    with pytest.warns(DeprecationWarning):
        assert s.blocks_needed(req) == s.kv_manager.blocks_needed(req) == 3
    with pytest.warns(DeprecationWarning):
        assert s.kv_needed(req) == s.kv_manager.kv_needed_for(req) == 12
    with pytest.warns(DeprecationWarning, match="rid in scheduler"):
        assert s.has_request("b") and not s.has_request("a")
    with pytest.warns(DeprecationWarning):
        assert callable(s.priority_key)


def test_an_alias_is_read_only_and_changes_nothing():
    """Assigning to an alias raises AttributeError naming where the value lives; the config is unchanged."""
    s = Scheduler(8, 2, 100)
    with pytest.raises(AttributeError, match=r"token_budget is read-only.*scheduler\.config\.token_budget"):
        s.token_budget = 4  # type: ignore[misc]
    assert s.config.token_budget == 8 and s.schedule().token_budget == 8
