"""A streamed event stays one line for every line reader, whatever text a token holds."""

from __future__ import annotations

import json

import pytest

from stallfree.server.streaming import sse

# Every character str.splitlines (and so httpx's line reader) ends a line at, besides \n and \r.
BREAKS = ["\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r\n", "\n", "\r"]


@pytest.mark.parametrize("brk", BREAKS, ids=[f"U+{ord(b[0]):04X}" for b in BREAKS])
def test_an_event_is_one_line_for_splitlines_and_round_trips(brk):
    obj = {"choices": [{"index": 0, "text": f"a{brk}b é中"}]}
    event = sse(obj)
    assert event.endswith("\n\n")
    lines = event.splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == obj


def test_other_text_is_sent_as_utf8_not_escaped():
    assert sse({"text": "é中"}) == 'data: {"text":"é中"}\n\n'
