"""Sessions: multi-turn conversations and agents, each turn sent its think or tool time after the
previous turn's last token, its prompt the whole conversation so far plus its own new input.

Imports allowed: the standard library, stallfree._files, stallfree.sim.inputs.workload and
stallfree.sim.inputs.synthetic (length specs and their token counts).

The workload (SessionWorkload) is a Workload with one request per turn, in the order (session start,
session, turn), so a session's turns are consecutive rids; its `arrivals` hold each turn's session
start (what --rate-scale scales; the think times `delay_s` are never scaled). Turn k's prompt is

    system_prompt_tokens + sum over j < k of (input_tokens[j] + output_tokens[j]) + input_tokens[k]

tokens: one growing token stream per session, so stream block b (tokens [b*B, (b+1)*B)) has one
identity for every turn that holds it, and a turn's block hashes (the prompt's full blocks, then the
full blocks of its own output, which the scheduler caches when the turn finishes) make its history a
cached prefix. A block wholly inside a system prompt is named by that prompt's id, so sessions that
share a system prompt share its blocks.

The run is stallfree.sim.run.session_run.

Why one module of over 400 lines: the trace reader and the synthetic generator build sessions the same
way (_Turn, _Session, _build) and produce the same SessionWorkload; split apart, each half would import
the other's internals.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stallfree.sim.inputs.synthetic import _SUFFIX_HINT, MAX_LENGTH, LengthSpec, _sample_lengths, _whole_tokens
from stallfree.sim.inputs.workload import Workload

__all__ = [
    "MAX_TURNS",
    "SessionWorkload",
    "ThinkSpec",
    "dump_turn",
    "parse_system_prompt",
    "parse_think_spec",
    "synthetic_sessions",
]

#: The most turns one session may have (a guard against a typo such as --turns fixed:1e6).
MAX_TURNS = 10_000
# Stream block identities: session s's block b is s << 32 | b; system prompt p's block b is
# ~(p << 32 | b) (negative), so the two never meet. 2**32 blocks of >= 1 token exceed any context.
_SHIFT = 32
_KEPT_MESSAGES = 5


@dataclass(frozen=True, slots=True)
class SessionWorkload(Workload):
    """A Workload of sessions: one request per turn, a session's turns consecutive (module docstring).

    Attributes (per turn, aligned with arrivals, prompt_lens and output_lens):
        session: the session's index, 0 .. num_sessions - 1, in start order.
        turn: the turn's number in its session, 0, 1, ...
        delay_s: think or tool time before the turn, s (0.0 for turn 0).
        input_lens: the turn's new tokens (turn 0's without its system prompt).
    Attributes (per session):
        session_ids: the session's id as the trace names it (a string or an integer).
        system_ids: index of its system prompt, or -1 for none.
        system_lens: its system prompt's tokens (0 for none).

    Raises:
        ValueError: the per-turn tuples differ in length, or a session's turns are not consecutive
            and numbered 0, 1, ...
    """

    session: tuple[int, ...] = ()
    turn: tuple[int, ...] = ()
    delay_s: tuple[float, ...] = ()
    input_lens: tuple[int, ...] = ()
    session_ids: tuple[str | int, ...] = ()
    system_ids: tuple[int, ...] = ()
    system_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        n = len(self.arrivals)
        if not len(self.session) == len(self.turn) == len(self.delay_s) == len(self.input_lens) == n:
            raise ValueError(f"session workload {self.name!r}: per-turn fields differ in length from {n} turns")
        for i in range(n):
            first = i == 0 or self.session[i - 1] != self.session[i]
            if self.turn[i] != (0 if first else self.turn[i - 1] + 1):
                raise ValueError(f"session workload {self.name!r}: turn {i} is turn {self.turn[i]} of session "
                                 f"{self.session[i]}; a session's turns must be consecutive, from 0")

    @property
    def num_sessions(self) -> int:
        """Sessions with at least one turn in the workload."""
        return sum(1 for t in self.turn if t == 0)

    def next_turn(self, rid: int) -> int:
        """The rid of the turn after `rid` in its session, or -1 for its last turn."""
        nxt = rid + 1
        return nxt if nxt < len(self.turn) and self.turn[nxt] else -1

    def stream_hashes(self, rid: int, block_size: int, num_output: int) -> tuple[int, ...]:
        """Turn `rid`'s block hashes: one per full block of its prompt, then one per full block of its
        first `num_output` generated tokens whose KV is computed (prompt_len + num_output - 1 tokens:
        the last sampled token is never fed back), each block named by its place in the session's
        stream (module docstring)."""
        plen = self.prompt_lens[rid]
        n = (plen + max(num_output, 1) - 1) // block_size
        s = self.session[rid]
        sys_id, sys_blocks = self.system_ids[s], self.system_lens[s] // block_size
        base = s << _SHIFT
        if sys_id < 0 or not sys_blocks:
            return tuple(range(base, base + n))
        sys_base = sys_id << _SHIFT
        k = min(sys_blocks, n)
        return tuple(~(sys_base + b) for b in range(k)) + tuple(range(base + k, base + n))

    def history_lens(self) -> list[int]:
        """Per turn, the tokens before its new input: its system prompt and every earlier turn's input
        and output."""
        return [p - x for p, x in zip(self.prompt_lens, self.input_lens, strict=True)]

    def prefix_hit_bound(self, block_size: int) -> float | None:
        """The hit rate an infinite prefix cache reaches on these sessions: per turn, the full blocks of
        everything before its new input but the previous answer's last token (a sampled token is never
        fed back, so no engine holds its KV), for turn 0 its system prompt when an earlier-starting
        session used it, capped at prompt_len - 1 tokens as the scheduler computes the last token; hit
        prompt tokens / prompt tokens. Every answer of at least one token long leaves it at most one
        block per turn under the history's full blocks."""
        return self.subset_bound(range(len(self)), block_size)

    def subset_bound(self, rids: Sequence[int] | range, block_size: int) -> float:
        """prefix_hit_bound over the turns `rids` only (the turns one replica served, in rid order): a turn
        can hit its system prompt once an earlier turn among `rids` used it, and its session's stream up to
        what the latest earlier turn of its session among `rids` computed (that turn's prompt and output
        but the output's last token). Over every turn this is everything before the turn's new input but
        the previous answer's last token."""
        seen: set[int] = set()
        computed: dict[int, int] = {}
        hits = total = 0
        plens, outs = self.prompt_lens, self.output_lens
        for i in rids:
            plen = plens[i]
            total += plen
            s = self.session[i]
            sid = self.system_ids[s]
            h = self.system_lens[s] if sid >= 0 and sid in seen else 0
            if sid >= 0:
                seen.add(sid)
            h = max(h, computed.get(s, 0))
            computed[s] = plen + outs[i] - 1
            hits += min(h // block_size, (plen - 1) // block_size) * block_size
        return hits / total if total else 0.0

    def head(self, n: int) -> SessionWorkload:
        """The first n sessions (all of them when n >= num_sessions), every turn of each.

        Raises:
            ValueError: n < 1.
        """
        if n < 1:
            raise ValueError(f"number of sessions must be >= 1, got {n!r}")
        return self._select([i for i in range(len(self)) if self.session[i] < n], shift=0.0)

    def _select(self, idx: range | list[int], shift: float) -> SessionWorkload:
        """The turns `idx` (whole sessions: a window selects by session start, which every turn holds)."""
        idx = list(idx)
        keep = sorted({self.session[i] for i in idx})
        new = {s: k for k, s in enumerate(keep)}
        return replace(
            self,
            arrivals=tuple(self.arrivals[i] - shift for i in idx),
            prompt_lens=tuple(self.prompt_lens[i] for i in idx),
            output_lens=tuple(self.output_lens[i] for i in idx),
            session=tuple(new[self.session[i]] for i in idx),
            turn=tuple(self.turn[i] for i in idx),
            delay_s=tuple(self.delay_s[i] for i in idx),
            input_lens=tuple(self.input_lens[i] for i in idx),
            session_ids=tuple(self.session_ids[s] for s in keep),
            system_ids=tuple(self.system_ids[s] for s in keep),
            system_lens=tuple(self.system_lens[s] for s in keep),
        )


@dataclass(slots=True)
class _Turn:
    """One turn as read, before the sessions are laid out."""

    line: int
    key: str | int
    turn: int
    start: float
    delay: float
    input_len: int
    output_len: int
    system: str | int | None = None
    system_len: int = 0


@dataclass(slots=True)
class _Session:
    turns: list[_Turn] = field(default_factory=list)


def _build(sessions: list[_Session], name: str, skipped: int, notes: list[str]) -> SessionWorkload:
    """Lay sessions out in (start, first appearance) order, turns in order; compute the prompts."""
    order = sorted(range(len(sessions)), key=lambda k: sessions[k].turns[0].start)
    t0 = min(s.turns[0].start for s in sessions)
    sys_index: dict[str | int, int] = {}
    cols: dict[str, list[Any]] = {k: [] for k in ("arr", "plen", "olen", "sess", "turn", "delay", "inp")}
    ids: list[str | int] = []
    sys_ids: list[int] = []
    sys_lens: list[int] = []
    for new, k in enumerate(order):
        turns = sessions[k].turns
        first = turns[0]
        sid = -1 if first.system is None else sys_index.setdefault(first.system, len(sys_index))
        ids.append(first.key)
        sys_ids.append(sid)
        sys_lens.append(first.system_len)
        context = first.system_len
        for t in turns:
            plen = context + t.input_len
            cols["arr"].append(first.start - t0)
            cols["plen"].append(plen)
            cols["olen"].append(t.output_len)
            cols["sess"].append(new)
            cols["turn"].append(t.turn)
            cols["delay"].append(t.delay)
            cols["inp"].append(t.input_len)
            context = plen + t.output_len
    return SessionWorkload(
        arrivals=tuple(cols["arr"]), prompt_lens=tuple(cols["plen"]), output_lens=tuple(cols["olen"]), name=name,
        skipped_rows=skipped, notes=tuple(notes), session=tuple(cols["sess"]), turn=tuple(cols["turn"]),
        delay_s=tuple(cols["delay"]), input_lens=tuple(cols["inp"]), session_ids=tuple(ids),
        system_ids=tuple(sys_ids), system_lens=tuple(sys_lens),
    )


# ---------------------------------------------------------------------------------- trace


# ------------------------------------------------------------------------------ synthetic


@dataclass(frozen=True, slots=True)
class ThinkSpec:
    """A think or tool time distribution, s: fixed:S, uniform:LO,HI, exponential:MEAN or
    lognormal:MEDIAN,SIGMA (parse_think_spec)."""

    kind: str
    a: float = 0.0
    b: float = 0.0

    def __str__(self) -> str:
        if self.kind in ("fixed", "exponential"):
            return f"{self.kind}:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    def draw(self, rng: random.Random) -> float:
        """One think time, s (>= 0)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return rng.lognormvariate(math.log(self.a), self.b)


#: The longest think time a distribution may name, s (a day).
MAX_THINK_S = 86_400.0


def parse_think_spec(text: str | float) -> ThinkSpec:
    """Parse a think time: a number of seconds, or fixed:S, uniform:LO,HI, exponential:MEAN,
    lognormal:MEDIAN,SIGMA (seconds; 0 <= LO <= HI, MEDIAN > 0, SIGMA in [0, 10]).

    Raises:
        ValueError: anything else; the message quotes the text.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        if not (math.isfinite(text) and 0 <= text <= MAX_THINK_S):
            raise ValueError(f"think time {text!r} must be a finite number of seconds in [0, {MAX_THINK_S:g}]")
        return ThinkSpec("fixed", float(text))
    kind, _, rest = str(text).strip().partition(":")
    try:
        nums = [float(x) for x in rest.split(",")] if rest else []
    except ValueError:
        nums = [math.nan]
    ok = all(math.isfinite(x) and 0 <= x <= MAX_THINK_S for x in nums)
    if ok and kind in ("fixed", "exponential") and len(nums) == 1:
        return ThinkSpec(kind, nums[0])
    if ok and kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1]:
        return ThinkSpec(kind, nums[0], nums[1])
    if ok and kind == "lognormal" and len(nums) == 2 and nums[0] > 0 and nums[1] <= 10:
        return ThinkSpec(kind, nums[0], nums[1])
    raise ValueError(f"bad think time {text!r}; expected seconds, fixed:S, uniform:LO,HI (0 <= LO <= HI), "
                     f"exponential:MEAN or lognormal:MEDIAN,SIGMA (MEDIAN > 0, SIGMA <= 10), at most {MAX_THINK_S:g} s")


def parse_system_prompt(text: str) -> tuple[int, int]:
    """Parse "TOKENS" or "TOKENS,COUNT": a system prompt of TOKENS tokens, COUNT distinct ones (default
    1), each session drawing one. TOKENS takes vLLM's suffixes as every token flag does ("2k" = 2,000).

    Raises:
        ValueError: not one or two integers, TOKENS >= 0 and COUNT >= 1; the message quotes the text.
    """
    parts = text.split(",")
    try:
        nums = [_whole_tokens(x) if i == 0 else int(x) for i, x in enumerate(parts)]
    except ValueError:
        nums = []
    if len(nums) == 1:
        nums.append(1)
    if len(nums) != 2 or not 0 <= nums[0] <= MAX_LENGTH or not 1 <= nums[1] <= 1_000_000:
        raise ValueError(f"`system_prompt` wants TOKENS[,COUNT] (0 <= TOKENS <= {MAX_LENGTH:,}, "
                         f"1 <= COUNT <= 1,000,000; {_SUFFIX_HINT}), got {text!r}")
    return nums[0], nums[1]


def synthetic_sessions(
    num_sessions: int,
    rate: float,
    turns: LengthSpec,
    input_len: LengthSpec,
    output_len: LengthSpec,
    think: ThinkSpec,
    system_tokens: int = 0,
    num_system_prompts: int = 1,
    seed: int = 0,
    max_total_turns: int | None = None,
) -> SessionWorkload:
    """Draw conversations: sessions start as a Poisson process at `rate`, each with a number of turns
    drawn from `turns`, each turn's new input and output drawn from `input_len` and `output_len` and
    its think time (turns >= 1) from `think`; with system_tokens > 0 every session opens with one of
    `num_system_prompts` system prompts of that many tokens, drawn uniformly.

    Args:
        num_sessions: sessions, >= 1.
        rate: session starts per second, > 0.
        turns: turns per session (a length spec; a session drawn with more than MAX_TURNS is refused).
        input_len, output_len: tokens per turn.
        think: think time before each turn after the first, s.
        system_tokens, num_system_prompts: the shared system prompts (0 tokens: none).
        seed: seeds everything (same seed, same workload).
        max_total_turns: refuse sessions whose turns come to more than this, before any turn is laid out
            (None: no bound).

    Raises:
        ValueError: a count or rate out of range; a session drawn with more than MAX_TURNS turns, or more
            than max_total_turns turns in all (the message names `turns` and its value).
        TraceError: a `trace:PATH` spec names an unreadable trace.
    """
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise ValueError(f"num_sessions must be an integer >= 1, got {num_sessions!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (sessions/s), got {rate!r}")
    rng = random.Random(seed)
    start, sessions = 0.0, []
    counts = [max(1, c) for c in _sample_lengths(turns, rng, num_sessions, 0)]
    most = max(counts)
    if most > MAX_TURNS:
        raise ValueError(f"`turns` {turns} draws a session of {most:,} turns; a session has at most "
                         f"{MAX_TURNS:,} turns")
    total = sum(counts)
    if max_total_turns is not None and total > max_total_turns:
        raise ValueError(f"`turns` {turns} over {num_sessions:,} sessions draws {total:,} turns, more than a "
                         f"synthetic run draws (at most {max_total_turns:,} requests)")
    for k in range(num_sessions):
        if k:
            start += rng.expovariate(rate)
        n = counts[k]
        ins = _sample_lengths(input_len, rng, n, 0)
        outs = _sample_lengths(output_len, rng, n, 1)
        sys_id = rng.randrange(num_system_prompts) if system_tokens else None
        s = _Session()
        for t in range(n):
            s.turns.append(_Turn(0, k, t, start, think.draw(rng) if t else 0.0, ins[t], outs[t],
                                 sys_id if t == 0 else None, system_tokens if t == 0 and sys_id is not None else 0))
        sessions.append(s)
    sys_text = f"; system {system_tokens}x{num_system_prompts}" if system_tokens else ""
    name = (f"sessions(rate={rate:g}/s, turns {turns}; input {input_len}; output {output_len}; think {think}"
            f"{sys_text}; seed {seed})")
    return _build(sessions, name, 0, [])


def dump_turn(obj: dict[str, Any]) -> str:
    """One session-trace line (tests and docs write traces with it)."""
    return json.dumps(obj, separators=(",", ":"))
