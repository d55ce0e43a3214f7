"""Synthetic workloads: Poisson or gamma arrivals with fixed, uniform or trace-drawn lengths, and the
shared-prefix load (groups of requests that share a system prompt).

Imports allowed: the standard library and stallfree.sim.inputs.
"""

from __future__ import annotations

import math
import random
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import accumulate

from stallfree.sim.inputs.traces import load_bundled, load_trace
from stallfree.sim.inputs.workload import Workload

__all__ = [
    "LengthSpec",
    "parse_length_spec",
    "parse_shared_prefix",
    "shared_prefix",
    "synthetic",
]


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token-length distribution: fixed, uniform (inclusive), lognormal (by median and sigma,
    capped at `hi`), or resampled from a trace (`path` None means the bundled one).

    Build one with parse_length_spec().
    """

    kind: str
    lo: float = 0.0
    hi: float = 0.0
    path: str | None = None

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.lo:g}"
        if self.kind == "trace":
            return "trace" + (f":{self.path}" if self.path else "")
        return f"{self.kind}:{self.lo:g},{self.hi:g}"


# The longest length a distribution may name, tokens: beyond any model context, far below float overflow.
MAX_LENGTH = 10_000_000

# vLLM's token suffixes, as stallfree._argtypes.parse_token_count reads them for every token flag (lowercase
# decimal, uppercase binary). Repeated here because this module may import only the standard library and
# stallfree.sim.inputs; tests/sim/test_workload.py holds the two to the same values.
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_SUFFIXED = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG])\s*$")
_SUFFIX_HINT = "token counts may end in k, m, g = 10^3, 10^6, 10^9 or K, M, G = 2^10, 2^20, 2^30, as in vLLM"


def _tokens(text: str) -> float:
    """A token count of a length spec: a number, or a whole count with a vLLM suffix ("2k" = 2,000, "2K" =
    2,048, "1.5k" = 1,500).

    Raises:
        ValueError: neither, or a suffixed count that is not a whole number of tokens ("1.0005k").
    """
    m = _SUFFIXED.match(text)
    if m is None:
        return float(text)
    value = Fraction(m.group(1)) * _SUFFIXES[m.group(2)]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return float(value)


def _whole_tokens(text: str) -> int:
    """A whole count of tokens: an integer, or a count with a vLLM suffix as _tokens reads it ("2k" = 2,000,
    "2K" = 2,048).

    Raises:
        ValueError: neither, or a suffixed count that is not a whole number of tokens.
    """
    return int(_tokens(text)) if _SUFFIXED.match(text) else int(text)


def parse_length_spec(text: str) -> LengthSpec:
    """Parse "fixed:N", "uniform:LO,HI", "lognormal:MEDIAN,SIGMA", "trace" or "trace:PATH". N, LO, HI and
    MEDIAN are tokens and take vLLM's suffixes as every token flag does ("fixed:2k" = 2,000, "uniform:1K,4K"
    = 1,024 to 4,096); N, LO and HI are whole counts (MEDIAN may have a fraction: the draws are rounded);
    SIGMA is a plain number.

    Raises:
        ValueError: an unknown kind, a bad number or a fixed or uniform count with a fraction; the message
            quotes the text.
    """
    kind, _, rest = text.strip().partition(":")
    try:
        # A lognormal's second number is its sigma, not a count of tokens: no suffix there.
        nums = ([float(x) if kind == "lognormal" and i == 1 else _tokens(x) for i, x in enumerate(rest.split(","))]
                if rest and kind != "trace" else [])
    except ValueError:
        raise ValueError(f"bad length distribution {text!r}: {rest!r} is not a list of numbers "
                         f"({_SUFFIX_HINT})") from None
    if any(not math.isfinite(x) or x > MAX_LENGTH for x in nums):
        raise ValueError(f"bad length distribution {text!r}: numbers must be finite and at most {MAX_LENGTH:,}")
    if kind == "lognormal" and len(nums) == 2 and nums[1] > 10:
        raise ValueError(f"bad length distribution {text!r}: a lognormal sigma above 10 overflows")
    if kind in ("fixed", "uniform") and any(x != int(x) for x in nums):
        # A count of tokens (or turns) is whole: fixed:1.9 was run as 1 while the header echoed 1.9.
        what = ("N of fixed:N must be a whole number" if kind == "fixed"
                else "LO and HI of uniform:LO,HI must be whole numbers")
        raise ValueError(f"bad length distribution {text!r}: {what}, got {next(x for x in nums if x != int(x)):g}")
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
        return LengthSpec("fixed", nums[0], nums[0])
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
        return LengthSpec("uniform", nums[0], nums[1])
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        return LengthSpec("lognormal", nums[0], nums[1])
    if kind == "trace":
        return LengthSpec("trace", path=rest or None)
    raise ValueError(
        f"bad length distribution {text!r}; expected fixed:N, uniform:LO,HI (1 <= LO <= HI), "
        "lognormal:MEDIAN,SIGMA (MEDIAN >= 1, SIGMA >= 0), trace or trace:PATH"
    )


def _trace_pairs(spec: LengthSpec) -> list[tuple[int, int]]:
    wl = load_trace(spec.path) if spec.path else load_bundled()
    return list(zip(wl.prompt_lens, wl.output_lens, strict=True))


def _sample_lengths(spec: LengthSpec, rng: random.Random, n: int, which: int) -> list[int]:
    if spec.kind == "fixed":
        return [int(spec.lo)] * n
    if spec.kind == "uniform":
        return [rng.randint(int(spec.lo), int(spec.hi)) for _ in range(n)]
    if spec.kind == "lognormal":
        mu = math.log(spec.lo)
        return [max(1, round(rng.lognormvariate(mu, spec.hi))) for _ in range(n)]
    pairs = _trace_pairs(spec)
    return [rng.choice(pairs)[which] for _ in range(n)]


def _gaps(rng: random.Random, n: int, rate: float, arrival: str, burstiness: float) -> Iterator[float]:
    if arrival == "poisson":
        for _ in range(n):
            yield rng.expovariate(rate)
    else:
        # Gamma gaps with shape k = burstiness and mean 1/rate: CV^2 = 1/k, so k = 1 is Poisson
        # and k < 1 is burstier (the burstiness factor of vLLM's serving benchmark).
        scale = 1.0 / (rate * burstiness)
        for _ in range(n):
            yield rng.gammavariate(burstiness, scale)


def synthetic(
    num_requests: int,
    rate: float,
    prompt_len: LengthSpec,
    output_len: LengthSpec,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Draw a synthetic workload: the first request at 0 s, then random gaps.

    When both lengths are `trace` specs of the same trace, (prompt, output) pairs are resampled
    together, keeping their correlation; otherwise each is drawn on its own.

    Args:
        num_requests: requests to draw, >= 1.
        rate: mean arrivals per second, > 0.
        prompt_len: prompt length distribution, tokens.
        output_len: output length distribution, tokens.
        arrival: "poisson" (exponential gaps) or "gamma" (Gamma gaps of shape `burstiness`).
        burstiness: Gamma shape, > 0 (1 = Poisson, < 1 burstier); ignored for poisson.
        seed: seed of the random.Random that draws everything (same seed, same workload).

    Raises:
        ValueError: a count, rate or burstiness out of range, or an unknown arrival process.
        TraceError: a `trace:PATH` length spec names an unreadable trace.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (requests/s), got {rate!r}")
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    rng = random.Random(seed)
    # Drawn straight into C arrays (8 bytes an arrival, 4 a length; a tuple of Python numbers takes 32 to
    # 36 a value): a day of a fleet's traffic is millions of requests. The same draws, in the same order.
    arrivals = array("d", accumulate(_gaps(rng, num_requests - 1, rate, arrival, burstiness), initial=0.0))
    if prompt_len.kind == "trace" and output_len.kind == "trace" and prompt_len.path == output_len.path:
        pairs = _trace_pairs(prompt_len)
        choice = rng.choice
        prompts, outputs = array("i"), array("i")
        for _ in range(num_requests):
            p, o = choice(pairs)
            prompts.append(p)
            outputs.append(o)
    else:
        prompts = array("i", _sample_lengths(prompt_len, rng, num_requests, 0))
        outputs = array("i", _sample_lengths(output_len, rng, num_requests, 1))
    label = f"{arrival}(rate={rate:g}" + (f", burstiness={burstiness:g}" if arrival == "gamma" else "")
    return Workload(
        arrivals=arrivals,
        prompt_lens=prompts,  # type: ignore[arg-type]
        output_lens=outputs,  # type: ignore[arg-type]
        name=f"{label}; prompt {prompt_len}; output {output_len}; seed {seed})",
    )


def parse_shared_prefix(text: str) -> tuple[int, int, int, int]:
    """Parse "G,P,S,Q" (groups, prompts per group, system prompt tokens, question tokens). S and Q are tokens
    and take vLLM's suffixes as every token flag does ("8,4,2k,128": 2,000-token system prompts).

    Raises:
        ValueError: not four integers, G, P, Q >= 1 and S >= 0; the message quotes the text.
    """
    try:
        g, p, s, q = (int(x) if i < 2 else _whole_tokens(x) for i, x in enumerate(text.split(",")))
    except ValueError:
        raise ValueError(f"`shared_prefix` wants GROUPS,PROMPTS,SYSTEM_TOKENS,QUESTION_TOKENS ({_SUFFIX_HINT}), "
                         f"got {text!r}") from None
    if g < 1 or p < 1 or s < 0 or q < 1 or s + q > MAX_LENGTH or g * p > 5_000_000:
        raise ValueError(f"`shared_prefix` {text!r}: needs GROUPS >= 1, PROMPTS >= 1, SYSTEM_TOKENS >= 0, "
                         f"QUESTION_TOKENS >= 1, at most 5,000,000 prompts and {MAX_LENGTH:,} tokens per prompt")
    return g, p, s, q


def shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: LengthSpec,
    rate: float,
    block: int = 16,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Draw a shared-prefix workload: `num_groups` groups of `prompts_per_group` prompts; every prompt of a
    group starts with the group's system prompt of `system_len` tokens and ends with its own question of
    `question_len` tokens (prompt_len = system_len + question_len), as the shared-prefix benchmarks of
    inference-perf (`shared_prefix`) and SGLang (`generated-shared-prefix`) build them. The prompts are
    shuffled across groups (seeded) and arrive at `rate`.

    The workload carries prefix ids of `block` tokens (Workload.prefix_ids, prefix_block = block): a block
    that holds system tokens only has its group's id for that position; a block that holds any question
    token is the request's own. So prefix caching (a paged scheduler with block_size dividing `block`) can
    hit the system prompt's full blocks, floor(system_len / block) x block tokens, in every prompt but the
    first of its group.

    Args:
        num_groups, prompts_per_group: G >= 1, P >= 1.
        system_len: S tokens, >= 0; question_len: Q tokens, >= 1.
        output_len: output length distribution, tokens (e.g. fixed:O).
        rate: mean arrivals per second, > 0; arrival, burstiness: as in synthetic().
        block: tokens per prefix block, >= 1 (the scheduler's block_size or a multiple of it).
        seed: seeds the shuffle, the gaps and the output lengths.

    Raises:
        ValueError: a count, length, rate or block out of range.
    """
    for name, v, lo in (("num_groups", num_groups, 1), ("prompts_per_group", prompts_per_group, 1),
                        ("system_len", system_len, 0), ("question_len", question_len, 1), ("block", block, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"shared prefix: {name} must be an integer >= {lo}, got {v!r}")
    base = synthetic(num_groups * prompts_per_group, rate, LengthSpec("fixed", 1, 1), output_len, arrival,
                     burstiness, seed)
    rng = random.Random(seed + 1)
    order = [g for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    plen = system_len + question_len
    nblocks = -(-plen // block)
    shared_blocks = system_len // block
    ids: list[tuple[int, ...]] = []
    next_own = num_groups * shared_blocks
    for g in order:
        row = [g * shared_blocks + j for j in range(shared_blocks)]
        row += range(next_own, next_own + nblocks - shared_blocks)
        next_own += nblocks - shared_blocks
        ids.append(tuple(row))
    name = (f"shared-prefix(groups={num_groups}, prompts={prompts_per_group}, system={system_len}, "
            f"question={question_len}; output {output_len}; rate={rate:g}; seed {seed})")
    return replace(base, prompt_lens=(plen,) * len(order), prefix_ids=tuple(ids), prefix_block=block, name=name)
