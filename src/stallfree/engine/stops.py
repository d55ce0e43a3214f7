"""Find a request's stop strings in its output text as it grows, in one pass over each new character
whatever the number of stop strings.

Imports allowed: the standard library only.

Source: the Aho-Corasick automaton (Aho and Corasick, "Efficient string matching: an aid to
bibliographic search", CACM 18(6), 1975): a trie of the patterns with failure links, so that the text
is read once and every pattern occurrence is reported where it ends. Checking each stop string with
str.find on every token cost one scan per stop string per token: with 190,000 stop strings in each of
32 requests, a live stream's median gap between tokens went from 0.059 s to 0.58 s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """The earliest stop string in a text fed to it piece by piece.

    Building costs one step per character of the stop strings; feeding costs one step per new text
    character (amortized), not per stop string.

    Args:
        stops: the stop strings, each non-empty.

    Raises:
        ValueError: a stop string is empty (it would match at once).

    Example:
        >>> m = StopMatcher(["lo w", "world"])
        >>> m.feed("hel"), m.feed("lo wor")
        (-1, 3)
    """

    __slots__ = ("_fail", "_goto", "_longest", "_pos", "_state")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r:.80}")
        self._goto: list[dict[str, int]] = [{}]
        self._longest: list[int] = [0]  # the longest stop string ending at this state (0: none)
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._longest.append(0)
                node = nxt
            self._longest[node] = max(self._longest[node], len(s))
        self._fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:  # breadth first: a state's failure link is set before its children's
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                link = self._goto[f].get(ch, 0)
                self._fail[child] = link if link != child else 0
                self._longest[child] = max(self._longest[child], self._longest[self._fail[child]])
                queue.append(child)
        self._state = 0
        self._pos = 0  # characters fed so far

    def feed(self, text: str) -> int:
        """Read the next piece of the text; return where (in characters from the start of everything
        fed) the earliest stop string that ends in this piece begins, or -1 when none ends in it.

        Of several stop strings completed in one piece, the one starting first wins, as a search of
        the whole text for each of them would pick."""
        goto, fail, longest = self._goto, self._fail, self._longest
        state, best = self._state, -1
        for i, ch in enumerate(text, self._pos):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if longest[state]:
                start = i - longest[state] + 1
                if best < 0 or start < best:
                    best = start
        self._state = state
        self._pos += len(text)
        return best
