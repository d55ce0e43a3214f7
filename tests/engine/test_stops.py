"""StopMatcher: the earliest stop string in a growing text, in one pass (issue 37)."""

from __future__ import annotations

import random

import pytest

from stallfree.engine.stops import StopMatcher


def _earliest(text: str, stops: list[str]) -> int:
    """The reference: the smallest str.find position of any stop string, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=-1)


def test_hand_cases():
    """Overlapping stops completed in one piece: the one starting first wins; fed piece by piece, the first
    one completed wins (the text cannot wait for a longer one that may never come)."""
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == 1
    m = StopMatcher(["abcd", "bc"])
    assert (m.feed("xa"), m.feed("b"), m.feed("c")) == (-1, -1, 2)
    m = StopMatcher(["he", "she", "hers"])
    assert m.feed("ushers") == 1
    assert StopMatcher(["END"]).feed("no stop here") == -1


def test_empty_stop_is_refused():
    """An empty stop string would match at once: a ValueError."""
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed{s}")
def test_matches_the_find_reference_fed_in_random_pieces(seed):
    """Random stops over a 3-letter alphabet, text fed in random pieces: the first piece with a match reports
    the position str.find gives on the text so far, and no earlier piece reports one."""
    rng = random.Random(seed)
    for _ in range(200):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        m, fed, got = StopMatcher(stops), "", -1
        while text and got < 0:
            cut = rng.randint(1, 4)
            piece, text = text[:cut], text[cut:]
            fed += piece
            got = m.feed(piece)
            if got < 0:
                assert _earliest(fed, stops) == -1
        assert got == _earliest(fed, stops)


def test_many_stops_cost_per_character_not_per_stop():
    """190,000 stop strings: building is linear in their characters and feeding 1,000 characters stays
    far under a second (str.find per stop string took seconds: 190,000 finds per character). The
    bound is loose on purpose, a guard against going back to per-stop work, not a speed target."""
    import time

    stops = [f"{i:06d}x" for i in range(190_000)]
    m = StopMatcher(stops)
    t0 = time.perf_counter()
    for ch in "abc def ghi " * 84:
        assert m.feed(ch) == -1
    assert time.perf_counter() - t0 < 1.0
    assert m.feed("123456x") == 1008
