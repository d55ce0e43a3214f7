"""Sampling parameters of a request (SamplingParams) and turning logits into tokens.

Imports allowed: the standard library, torch, stallfree.engine.errors.

Source: temperature, top-k (Fan et al., 2018), nucleus / top-p (Holtzman et al., ICLR 2020) and
min-p (Nguyen et al., 2024) sampling; the parameter names and ranges are OpenAI's and vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stallfree.engine.errors import InvalidSamplingParams

__all__ = ["GREEDY_BELOW", "NO_TOKEN", "SamplingParams", "sample_one", "sample_tokens"]

#: Temperatures below this are sampled greedily (argmax), as in vLLM (its _SAMPLING_EPS, 1e-5): dividing
#: float32 logits by a smaller temperature overflows them to inf for any logit gap above about 1e33 * t,
#: and softmax of inf is NaN. Below 1e-5 a temperature keeps only the argmax anyway for any gap over
#: about 1e-3 (exp(-1e-3 / 1e-5) = exp(-100)), so the rule changes the distribution by under e**-100.
GREEDY_BELOW = 1e-5
#: The token sample_tokens returns for a row it cannot sample (non-finite logits or probabilities).
NO_TOKEN = -1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    Args:
        max_tokens: the most tokens to generate, >= 1.
        temperature: 0 for greedy (argmax); otherwise logits are divided by it, 0 <= t <= 2. A
            temperature below GREEDY_BELOW (1e-5) is greedy too (vLLM's rule), so that no positive
            temperature, however small (1e-40), overflows the logits.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p, 0 < p <= 1.
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        min_p: drop tokens less likely than min_p times the most likely one, 0 <= m <= 1.
        seed: a seed for this request's sampler (reproducible sampling), or None.
        stop: strings that end generation; the text returned stops before them.
        stop_token_ids: token ids that end generation (the token is emitted, its text is not).
        ignore_eos: keep generating past the model's EOS tokens.
        priority: passed through for the server; the engine's scheduler ignores it.

    Raises:
        InvalidSamplingParams (a ValueError): a field is out of range or of the wrong type; the
            message names the field and the value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= 2:
            raise bad("temperature", "a number in [0, 2]")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "-1, 0 (both: no limit) or an integer >= 1")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "an integer in [0, 2**64) or None")
        if not _is_int(self.priority):
            raise bad("priority", "an integer")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        # Accept a single string or any sequence; store tuples so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if ids is None or not all(_is_int(i) and i >= 0 for i in ids):
            raise bad("stop_token_ids", "a list of integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature 0, or below GREEDY_BELOW (1e-5)."""
        return self.temperature < GREEDY_BELOW


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Sample one token from one row of logits.

    Shapes: logits [V] float32.

    Args:
        generator: the request's random generator (seeded if params.seed is set).

    Returns:
        The token id; argmax (lowest id on a tie) when params.greedy (temperature < 1e-5).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[0]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep a token if the mass before it is below top_p, so the most likely is always kept.
        drop = (torch.cumsum(sorted_p, dim=0) - sorted_p) >= params.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token per row, all rows at once.

    Greedy rows take the argmax (lowest id on a tie). The other rows are filtered together
    (temperature, then top-k, min-p and top-p on the probabilities sorted once) and each draws
    one uniform number from its own generator, so a seeded request samples the same tokens alone
    or batched (its row's arithmetic does not depend on the other rows).

    A row that cannot be sampled gets NO_TOKEN (-1) and leaves the other rows as they would be alone:
    a row whose logits hold NaN or inf (the model's output, greedy or not), or whose filtered
    probabilities do not sum to a finite positive number. The caller fails that row's request only.

    Shapes: logits [S, V] float32; returns [S] int64 on logits' device.

    Args:
        params: each row's sampling parameters.
        generators: each row's generator (None: torch's default one).
    """
    out = torch.argmax(logits, dim=-1)
    # A row holding NaN or inf sums to NaN or inf (finite logits are far too small to overflow a sum):
    # one reduction, not a [S, V] mask.
    out = out.masked_fill(~torch.isfinite(logits.float().sum(dim=-1)), NO_TOKEN)
    idx = [i for i, p in enumerate(params) if not p.greedy]
    if not idx:
        return out
    dev = logits.device
    ps = [params[i] for i in idx]
    vocab = logits.shape[-1]
    # One host-to-device copy for all rows' parameters: temperature, top-k, min-p, top-p, row.
    knobs = torch.tensor([[p.temperature, p.top_k if p.top_k > 0 else vocab, p.min_p, p.top_p, i]
                          for p, i in zip(ps, idx, strict=True)], dtype=torch.float64).to(dev)
    temp, k, min_p, top_p = (knobs[:, j : j + 1] for j in range(4))
    rows = knobs[:, 4].long()
    x = logits[rows].float() / temp.float()
    x, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    probs = torch.softmax(x.masked_fill(rank >= k, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs < min_p.float() * probs[:, :1], 0.0)
    # Keep a token if the mass before it is below top_p, so the most likely is always kept.
    probs = probs.masked_fill((torch.cumsum(probs, dim=-1) - probs >= top_p.float()) & (rank > 0), 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=generators[i], device=dev) for i in idx])
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    # A pick past the last kept token (rounding at u close to 1) falls back to the last kept one.
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, kept)
    total = cdf[:, -1]
    ok = torch.isfinite(total) & (total > 0) & (kept[:, 0] >= 0) & (out[rows] != NO_TOKEN)
    out[rows] = torch.where(ok, order.gather(1, pick.clamp(min=0)).squeeze(1), NO_TOKEN)
    return out
