"""argparse value types shared by every subcommand: each turns one command-line word into a value or
raises argparse.ArgumentTypeError with a message naming what was expected and what was given.

Imports allowed: the standard library, and stallfree.core lazily (any subpackage's CLI may import this
leaf module; every subpackage may import the core).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "add_partial_prefill_args",
    "float_at_least",
    "float_between",
    "parse_token_count",
    "token_count",
    "token_count_list",
    "int_at_least",
    "int_between",
    "int_list",
    "list_items",
    "non_negative_float",
    "partial_prefill_flag_problem",
    "port",
    "positive_float",
    "positive_float_at_most",
    "positive_float_list",
    "positive_fraction",
    "non_negative_int",
    "out_dir",
    "positive_int",
    "tenant_weights",
]


def _int_at_least(text: str, minimum: int) -> int:
    """`text` as an integer >= `minimum`, or argparse.ArgumentTypeError naming the bound and the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def out_dir(text: str) -> Path:
    """A directory to write files in (--out DIR). An empty word is refused: Path("") is the current
    directory, so `--out ''` (an unset shell variable) would write there; `--out .` says so.

    Raises:
        argparse.ArgumentTypeError: `text` is empty or only spaces.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r} (give . for the current directory)")
    return Path(text)


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of tokens, sequences, requests...).

    Raises:
        argparse.ArgumentTypeError: `text` is not an integer, or is < 1.
    """
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a count that may be zero, e.g. steps).

    Raises:
        argparse.ArgumentTypeError: `text` is not an integer, or is < 0.
    """
    return _int_at_least(text, 0)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (for a count with a floor of its own, e.g. requests that
    must split into two halves of two).

    The type raises argparse.ArgumentTypeError when the text is not an integer, or is < `minimum`.
    """

    def parse(text: str) -> int:
        return _int_at_least(text, minimum)

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [`low`, `high`] (a count with a cap on the work it asks for, e.g.
    replicas, each a whole simulated engine).

    The type raises argparse.ArgumentTypeError when the text is not an integer, or is outside
    [`low`, `high`].
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text!r}")
        return value

    parse.__name__ = f"int_between_{low}_{high}"
    return parse


#: Token-count suffixes, vLLM's rule (its human-readable integers): lowercase decimal, uppercase binary.
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*$")


def parse_token_count(text: str) -> int:
    """A count of tokens with an optional suffix, as vLLM reads one: k, m, g multiply by 10^3, 10^6, 10^9 and
    K, M, G by 2^10, 2^20, 2^30 ("2M" = 2,097,152; "2m" = 2,000,000; "1.5k" = 1,500). A fraction must
    come to a whole number of tokens.

    Raises:
        ValueError: not such a count, or a fraction that is not a whole number of tokens.
    """
    m = _COUNT.match(text)
    if m is None:
        raise ValueError(f"expected a whole number of tokens (suffixes k, m, g = 10^3, 10^6, 10^9; K, M, G = 2^10, "
                         f"2^20, 2^30), got {text!r}")
    digits, suffix = m.groups()
    from fractions import Fraction

    value = Fraction(digits) * _SUFFIXES.get(suffix, 1)
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


def token_count(text: str) -> int:
    """An argparse type: a count of tokens >= 1, with vLLM's suffixes (parse_token_count).

    Raises:
        argparse.ArgumentTypeError: not such a count, or < 1.
    """
    try:
        value = parse_token_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count of tokens >= 1, got {text!r}")
    return value


def list_items(text: str) -> list[str]:
    """The comma-separated items of a list flag's value, stripped; an empty item ("512,,1024", "512,") is an
    error rather than dropped, as is an item given twice (a list names each value once).

    Raises:
        argparse.ArgumentTypeError: an empty or repeated item.
    """
    items = [t.strip() for t in text.split(",")]
    if text.strip() and not all(items):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}: give the values separated by single commas")
    twice = next((t for i, t in enumerate(items) if t and t in items[:i]), None)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"{twice!r} is given twice in {text!r}; give each value once")
    return [t for t in items if t]


def token_count_list(text: str) -> list[int]:
    """An argparse type: a comma-separated, non-empty list of token counts >= 1, each with vLLM's suffixes
    ("512,2k,8K").

    Raises:
        argparse.ArgumentTypeError: an item is not such a count, empty or repeated, or the list is empty.
    """
    out = [token_count(t) for t in list_items(text)]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of token counts >= 1, got {text!r}")
    return out


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0.

    Raises:
        argparse.ArgumentTypeError: `text` is not a finite number, or is <= 0.
    """
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (seconds, for example).

    Raises:
        argparse.ArgumentTypeError: `text` is not a finite number, or is < 0.
    """
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_fraction(text: str) -> float:
    """A finite number in (0, 1]: a share of something (GPU memory) or an efficiency against a peak (MFU).

    Raises:
        argparse.ArgumentTypeError: `text` is not a finite number, or is outside (0, 1].
    """
    return positive_float_at_most(1)(text)


def positive_float_at_most(high: float) -> Callable[[str], float]:
    """An argparse type: a finite number in (0, `high`] (a factor with a sanity cap, e.g. a load of at
    most 100 times the engine's speed).

    The type raises argparse.ArgumentTypeError when the text is not a finite number, or is outside
    (0, `high`].
    """

    def parse(text: str) -> float:
        value = _number(text)
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"expected a number in (0, {high:g}], got {text!r}")
        return value

    parse.__name__ = f"positive_float_at_most_{high:g}"
    return parse


def float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= `minimum` (a ratio of at least 1, for example).

    The type raises argparse.ArgumentTypeError when the text is not a finite number, or is < `minimum`.
    """

    def parse(text: str) -> float:
        value = _number(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"float_at_least_{minimum:g}"
    return parse


def float_between(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number in [`low`, `high`] (an hour of the day, for example).

    The type raises argparse.ArgumentTypeError when the text is not a finite number, or is outside
    [`low`, `high`].
    """

    def parse(text: str) -> float:
        value = _number(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a number in [{low:g}, {high:g}], got {text!r}")
        return value

    parse.__name__ = f"float_between_{low:g}_{high:g}"
    return parse


def tenant_weights(text: str) -> dict[str, float]:
    """Tenant weights as NAME=WEIGHT pairs separated by commas ("a=2,b=0.5"): each weight a finite number > 0.

    Raises:
        argparse.ArgumentTypeError: a pair without '=', an empty name, a name given twice, or a weight that is
            not a finite number > 0 (the message names the pair).
    """
    out: dict[str, float] = {}
    for pair in text.split(","):
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT pairs separated by commas, got {pair!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"tenant {name!r} is given twice in {text!r}")
        try:
            out[name] = positive_float(value.strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"weight of tenant {name!r}: {exc}") from None
    return out


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks one).

    Raises:
        argparse.ArgumentTypeError: `text` is not an integer in 0..65535.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated, non-empty list of integers >= 1 ("256,512,1024").

    Raises:
        argparse.ArgumentTypeError: an item is not an integer >= 1, empty or repeated, or the list is empty.
    """
    out = [positive_int(t) for t in list_items(text)]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return out


def positive_float_list(text: str) -> list[float]:
    """A comma-separated, non-empty list of finite numbers > 0 ("1,2.5,4").

    Raises:
        argparse.ArgumentTypeError: an item is not a finite number > 0, empty or repeated, or the list is empty.
    """
    out = [positive_float(t) for t in list_items(text)]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers > 0, got {text!r}")
    return out


_PARTIAL_PREFILL_FLAGS = (
    ("max_num_partial_prefills", "--max-num-partial-prefills"),
    ("max_long_partial_prefills", "--max-long-partial-prefills"),
    ("long_prefill_token_threshold", "--long-prefill-token-threshold"),
    ("block_size", "--block-size"),
)


def partial_prefill_flag_problem(
    k: int, lng: int | None, thr: int | None, block_size: int | None = None
) -> str | None:
    """Check --max-num-partial-prefills K, --max-long-partial-prefills L and --long-prefill-token-threshold
    T as the scheduler will (stallfree.core.policies.check_partial_prefills), before any model or trace is
    loaded, so that every command (simulate, sweep, tune, generate, serve) refuses a bad combination with
    the same words. A missing T with K > 1 passes: the scheduler then takes 4% of the context length.
    `block_size`: the chunk alignment (paged KV), or None.

    Returns:
        None when they are fine, else a one-line message naming the flags and the values as typed.
    """
    if lng is not None and lng > k:
        return f"--max-long-partial-prefills {lng} must be <= --max-num-partial-prefills {k}"
    if k == 1:
        for flag, value in (("--max-long-partial-prefills", lng), ("--long-prefill-token-threshold", thr)):
            if value is not None:
                return f"{flag} {value} applies when --max-num-partial-prefills is > 1 (it is 1)"
    from stallfree.core.errors import InvalidConfig
    from stallfree.core.policies import check_partial_prefills

    try:
        check_partial_prefills(k, lng, thr if thr is not None or k == 1 else (block_size or 1), block_size)
    except InvalidConfig as exc:
        text = str(exc)
        for name, flag in _PARTIAL_PREFILL_FLAGS:
            text = text.replace(name, flag)
        return text
    return None


def add_partial_prefill_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, context: str) -> None:
    """Add vLLM's three partial-prefill flags (--max-num-partial-prefills K, --max-long-partial-prefills L,
    --long-prefill-token-threshold T, in tokens) to a command; `context` names what T's default is 4% of
    (the context length, max_model_len). Check them with partial_prefill_flag_problem."""
    parser.add_argument("--max-num-partial-prefills", type=positive_int, default=1, metavar="K",
                        help="prompts partially prefilled at once (default 1, the contract)")
    parser.add_argument("--max-long-partial-prefills", type=positive_int, default=None, metavar="L",
                        help="of those, at most L long ones (default 1)")
    parser.add_argument("--long-prefill-token-threshold", type=positive_int, default=None, metavar="T",
                        help=f"a prompt is long when more than T tokens are left (default: 4%% of {context})")
