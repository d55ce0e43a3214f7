"""Session traces: JSONL files of turns with a session_id, read into a SessionWorkload, and the test that
tells a session trace from a plain one.

Imports allowed: the standard library, stallfree._files and stallfree.sim.inputs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, Any

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, loads_line, open_text
from stallfree.sim.inputs.sessions import _KEPT_MESSAGES, SessionWorkload, _build, _Session, _Turn
from stallfree.sim.inputs.synthetic import MAX_LENGTH
from stallfree.sim.inputs.workload import (
    MAX_ARRIVAL_S,
    MAX_ARRIVAL_SPAN_S,
    TraceError,
    TraceFileError,
    not_json_error,
)

__all__ = [
    "is_session_trace",
    "load_sessions",
    "looks_like_sessions",
]


def looks_like_sessions(obj: object) -> bool:
    """Whether a trace's first JSON object is a session turn (it has a `session_id` key)."""
    return isinstance(obj, dict) and "session_id" in obj


def _count(obj: dict[str, Any], key: str, minimum: int, required: bool = True) -> int:
    v = obj.get(key)
    if v is None:
        if required:
            raise ValueError(f"missing field {key!r}")
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ValueError(f"{key} {v!r} is not an integer")
    if v < minimum or v > MAX_LENGTH:
        raise ValueError(f"{key} {v!r} must be an integer in [{minimum}, {MAX_LENGTH:,}]")
    return v


def _seconds(obj: dict[str, Any], key: str, limit: float) -> float:
    v = obj.get(key)
    if v is None:
        raise ValueError(f"missing field {key!r}")
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{key} {v!r} must be a finite number >= 0 s")
    if v > limit:
        raise ValueError(f"{key} {v!r} is past {limit:g} s")
    return float(v)


def _key(v: object, what: str) -> str | int:
    if isinstance(v, bool) or not isinstance(v, str | int) or (isinstance(v, str) and not v):
        raise ValueError(f"{what} {v!r} must be a non-empty string or an integer")
    return v


def _parse_turn(obj: object, line: int) -> _Turn:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "session_id" not in obj:
        raise ValueError("missing field 'session_id'")
    key = _key(obj["session_id"], "session_id")
    turn = _count(obj, "turn", 0)
    # Each field is read where the format defines it (start_s and the system prompt on turn 0, delay_s on
    # later turns) and ignored elsewhere, so a converter that writes every field on every line is read.
    if turn == 0:
        start, delay = _seconds(obj, "start_s", MAX_ARRIVAL_S), 0.0
    else:
        start, delay = 0.0, _seconds(obj, "delay_s", MAX_ARRIVAL_SPAN_S)
    t = _Turn(line, key, turn, start, delay, _count(obj, "input_tokens", 0), _count(obj, "output_tokens", 1))
    if turn == 0 and (obj.get("system_prompt_id") is not None or obj.get("system_prompt_tokens") is not None):
        t.system = _key(obj.get("system_prompt_id"), "system_prompt_id")
        t.system_len = _count(obj, "system_prompt_tokens", 1)
    if turn == 0 and not t.input_len and not t.system_len:
        raise ValueError("input_tokens 0 on turn 0 without a system prompt: the prompt would be empty")
    return t


def is_session_trace(path: str | Path) -> bool:
    """Whether `path` (a .jsonl or .json file, .gz allowed) starts with a session turn (a first object
    with a `session_id` key); False for anything else or a file that cannot be read (its reader then
    says why)."""
    name = Path(path).name.removesuffix(".gz")
    if not name.endswith((".jsonl", ".json")) or not Path(path).is_file():
        return False
    try:
        with open_text(path) as fh:
            first = next((ln for ln in bounded_lines(fh, path) if ln.strip()), "")
        return looks_like_sessions(loads_line(first))
    except READ_ERRORS:
        return False
    except ValueError:  # not JSON, or past the line limit: the trace's reader says why
        return False


def load_sessions(path: str | Path, skip_bad_rows: bool = False) -> SessionWorkload:
    """Read a session trace: JSONL, one object per turn (docs/simulator.md, "Sessions"): session_id (a
    string or an integer), turn (0, 1, ...), start_s (turn 0 only: the session's start, s), delay_s
    (turns >= 1: think or tool time, s), input_tokens (the turn's new tokens), output_tokens, and on
    turn 0 optionally system_prompt_id and system_prompt_tokens. Each field is read on the turns that
    define it and ignored on the others; input_tokens may be 0 where the prompt is not empty. `.gz` files
    are decompressed.

    A session's turns come in order in the file (turn k after turn k - 1), a (session, turn) once.

    Args:
        path: the file.
        skip_bad_rows: skip and count a malformed turn (and every later turn of its session, which
            can no longer be laid out) instead of raising at the first one.

    Raises:
        TraceFileError: the file is missing, a directory or cannot be opened.
        TraceError: "path:line: field value: reason" for a malformed turn (a missing or negative
            field, a turn before its session's turn 0 or out of order, a repeated (session, turn), a
            system prompt id reused with another length); the file past its limits; no turn left.
    """
    p = Path(path)
    if p.is_dir():
        raise TraceFileError(f"trace {path} is a directory: give one session trace file (JSONL, .gz allowed)")
    if not p.exists():
        raise TraceFileError(f"trace file not found: {path}")
    if not p.is_file():
        raise TraceFileError(f"trace {path} is not a regular file (a device, pipe or socket): give a trace file")
    try:
        with open_text(p) as fh:
            return _read(fh, str(path), skip_bad_rows, p.name.removesuffix(".gz"))
    except FileLimitError as exc:
        raise TraceError(f"trace {exc}") from None
    except READ_ERRORS as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None


def _read(fh: IO[str], path: str, skip: bool, name: str) -> SessionWorkload:
    sessions: dict[str | int, _Session] = {}
    broken: set[str | int] = set()
    system_lens: dict[str | int, tuple[int, int]] = {}
    bad, messages = 0, list[str]()
    for line, text in enumerate(bounded_lines(fh, path), start=1):
        if not text.strip():
            continue
        key: str | int | None = None
        try:
            try:
                obj = loads_line(text)
            except ValueError:  # json.JSONDecodeError
                if not sessions and not bad and line == 1:
                    raise not_json_error(path, text, "session", "session_id, turn, start_s or delay_s, "
                                         "input_tokens, output_tokens") from None
                raise
            if isinstance(obj, dict) and isinstance(obj.get("session_id"), str | int):
                key = obj["session_id"]
            t = _parse_turn(obj, line)
            s = sessions.get(t.key)
            if t.key in broken:
                raise ValueError(f"session_id {t.key!r}: an earlier turn of this session was skipped")
            have = len(s.turns) if s is not None else 0
            if t.turn < have:
                raise ValueError(f"session_id {t.key!r} turn {t.turn}: repeated (first on line {s.turns[t.turn].line})"
                                 if s is not None else "")
            if t.turn > have:
                what = "before its session's turn 0" if not have else f"after turn {have - 1}: turns go in order"
                raise ValueError(f"session_id {t.key!r} turn {t.turn}: {what}")
            if t.system is not None:
                known = system_lens.setdefault(t.system, (t.system_len, line))
                if known[0] != t.system_len:
                    raise ValueError(f"system_prompt_tokens {t.system_len} for system_prompt_id {t.system!r}, "
                                     f"which line {known[1]} gives {known[0]} tokens")
            if s is None:
                if sessions and abs(t.start - next(iter(sessions.values())).turns[0].start) > MAX_ARRIVAL_SPAN_S:
                    raise ValueError(f"start_s {t.start!r} is more than {MAX_ARRIVAL_SPAN_S:g} s from the first "
                                     "session's")
                s = sessions[t.key] = _Session()
            s.turns.append(t)
        except TraceError:
            raise
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            msg = f"{path}:{line}: {exc}"
            if not skip:
                raise TraceError(msg) from None
            bad += 1
            if len(messages) < _KEPT_MESSAGES:
                messages.append(msg)
            if key is not None and key in sessions:
                broken.add(key)
            continue
    if not sessions:
        raise TraceError(f"{path}: no session turns in the trace")
    notes = [f"skipped {bad} malformed turns (a later turn of a broken session among them); first: {messages[0]}"
             ] if bad else []
    return _build(list(sessions.values()), name, bad, notes)
