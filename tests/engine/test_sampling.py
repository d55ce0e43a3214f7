"""SamplingParams validation and the samplers' filtering."""

from __future__ import annotations

import pytest
import torch

from stallfree.engine import InvalidSamplingParams, SamplingParams
from stallfree.engine.sampling import sample_one


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True), ("temperature", -0.1),
     ("temperature", 2.5), ("top_p", 0), ("top_p", 1.1), ("top_k", -2), ("top_k", 2.0),
     ("min_p", 1.5), ("seed", "x"), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
     ("ignore_eos", 1), ("priority", 0.5)],
    ids=lambda v: repr(v),
)
def test_bad_fields_name_field_and_value(field, value):
    """Each out-of-range field raises InvalidSamplingParams (a ValueError) naming it and its value."""
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_defaults_and_normalisation():
    """A single stop string becomes a tuple; lists become tuples; temperature 0 is greedy."""
    p = SamplingParams(stop="END", stop_token_ids=[5], temperature=0, min_p=0.1)
    assert p.stop == ("END",) and p.stop_token_ids == (5,) and p.greedy
    assert SamplingParams().max_tokens == 16 and not SamplingParams().greedy


def test_top_k_one_and_tiny_top_p_are_greedy():
    """top_k=1, or a top_p below the top token's probability, always picks the argmax."""
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0, top_p=0.01)):
        assert {sample_one(logits, params, g) for _ in range(50)} == {1}


def test_min_p_drops_unlikely_tokens():
    """min_p=0.5 keeps only tokens at least half as likely as the best: here ids 1 and 2."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.4, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {sample_one(logits, SamplingParams(min_p=0.5), g) for _ in range(200)}
    assert seen == {1, 2}


def test_batched_sampling_rows_are_independent():
    """sample_tokens: a greedy row takes the argmax; a top_k=1 row takes its argmax whatever its
    generator; a seeded row samples the same token alone and next to other rows."""
    from stallfree.engine.sampling import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7)]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(7)]
    got = sample_tokens(logits, params, gens).tolist()
    assert got[:2] == [int(logits[0].argmax()), int(logits[1].argmax())]
    alone = sample_tokens(logits[2:], params[2:], [torch.Generator().manual_seed(7)]).tolist()
    assert alone == got[2:]


# ---------------------------------------------------------------- issue 37: a sampling fault fails its row alone


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 9e-6], ids=["1e-40", "1e-30", "9e-6"])
def test_temperature_below_greedy_threshold_is_greedy(temperature):
    """A temperature below GREEDY_BELOW (1e-5, vLLM's rule) is greedy: logits / 1e-40 would overflow to
    inf and softmax to NaN; instead the row takes its argmax, alone or batched with a sampled row."""
    from stallfree.engine.sampling import GREEDY_BELOW, sample_tokens

    assert GREEDY_BELOW == 1e-5 and SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    torch.manual_seed(3)
    logits = torch.randn(2, 49152) * 10
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=0.7, seed=1)]
    got = sample_tokens(logits, params, [None, torch.Generator().manual_seed(1)]).tolist()
    assert got[0] == int(logits[0].argmax())
    assert 0 <= got[1] < 49152


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_non_finite_row_gets_no_token_and_the_others_are_unchanged(greedy):
    """A row whose logits hold NaN or inf gets NO_TOKEN (-1), greedy or sampled; the other rows get the
    tokens they get without it (a seeded row the same token)."""
    from stallfree.engine.sampling import NO_TOKEN, sample_tokens

    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    bad = logits.clone()
    bad[1, 7] = float("nan")
    bad[2, 9] = float("inf")
    temp = 0 if greedy else 0.9
    params = [SamplingParams(temperature=0.8, seed=11)] + [SamplingParams(temperature=temp, seed=2)] * 2
    gens = lambda: [torch.Generator().manual_seed(11), torch.Generator().manual_seed(2),  # noqa: E731
                    torch.Generator().manual_seed(2)]
    got = sample_tokens(bad, params, gens()).tolist()
    assert got[1:] == [NO_TOKEN, NO_TOKEN]
    assert got[0] == sample_tokens(logits[:1], params[:1], gens()[:1]).tolist()[0]
