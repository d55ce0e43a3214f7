"""The engine with concurrent partial prefills on: greedy outputs equal each request run alone."""

from __future__ import annotations

import pytest

from stallfree.engine import SamplingParams

# Real-model runs with several partial prefills, compared with each request alone.
pytestmark = pytest.mark.slow

PROMPTS = {
    "long": "The history of the city begins with a small settlement on the river. " * 6,
    "mid": "List three colours of the rainbow and say why the sky is blue in one sentence.",
    "short": "Paris is",
    "long2": "Count slowly from one to twenty, writing every number as a word: " * 3,
}


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_greedy_outputs_with_partial_prefills_equal_running_alone(make_engine, run_to_end, kv_policy):
    """With max_num_partial_prefills=3, L=2, T=6 and a 16-token budget (so several prompts are partially
    prefilled in the same steps), every request's greedy tokens equal those it gets alone."""
    params = SamplingParams(max_tokens=5, temperature=0.0)
    alone = {}
    for rid, prompt in PROMPTS.items():
        eng = make_engine(token_budget=64, max_seqs=1, kv_policy=kv_policy)
        eng.add_request(rid, prompt, params)
        alone[rid] = [t for o in run_to_end(eng)[rid] for t in o.new_token_ids]
    eng = make_engine(token_budget=16, max_seqs=4, kv_policy=kv_policy, max_num_partial_prefills=3,
                      max_long_partial_prefills=2, long_prefill_token_threshold=6)
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    most_partial = 0
    while eng.has_unfinished():
        most_partial = max(most_partial, len(eng.scheduler.partial_prefills))
        for o in eng.step():
            outs[o.rid].extend(o.new_token_ids)
    assert most_partial >= 2  # the options were exercised
    assert outs == alone
