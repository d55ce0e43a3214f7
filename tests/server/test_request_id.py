"""X-Request-Id: a client's printable id up to 128 characters comes back in the header and in the logs;
anything else is replaced by a generated one; the body's `id` stays the server's own."""

from __future__ import annotations

import logging
import re

import pytest

from server.fake_engine import FakeEngine
from server.helpers import run
from server.ops_helpers import ops_client
from stallfree.server.options import OpsConfig
from stallfree.server.request_id import RequestIdFilter, current_request_id, valid_request_id

BODY = {"prompt": "hi", "max_tokens": 2}
GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize(("given", "kept"), [
    ("req-42", True), ("a" * 128, True), ("a" * 129, False), ("two words", False), ("line\tbreak", False),
    ("", False), ("caf\u00e9", False)], ids=["plain", "128", "129", "space", "tab", "empty", "non-ascii"])
def test_request_id_kept_or_replaced(given, kept):
    """A valid id is echoed; an invalid one is replaced by 32 hex digits; the body id is ours."""

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(log_access=False)) as c:
            r = await c.post("/v1/completions", json=BODY, headers={"X-Request-Id": given.encode("utf-8")})
            assert r.status_code == 200
            got = r.headers["x-request-id"]
            if kept:
                assert got == given
            else:
                assert GENERATED.fullmatch(got)
            assert r.json()["id"].startswith("cmpl-") and r.json()["id"] != got

    run(go())


def test_every_answer_has_an_id_and_an_access_line(caplog):
    """A 200, a 401 and a 404 each carry X-Request-Id; each has one access line naming the id, the
    route and the status; records made inside a request carry its id through RequestIdFilter."""
    caplog.set_level(logging.INFO, logger="stallfree.server.access")

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_key="sk-k")) as c:
            r1 = await c.get("/v1/models", headers={"Authorization": "Bearer sk-k", "X-Request-Id": "ok-1"})
            r2 = await c.get("/v1/models", headers={"X-Request-Id": "noauth-2"})
            r3 = await c.get("/nothing", headers={"X-Request-Id": "missing-3"})
            return [r.status_code for r in (r1, r2, r3)], [r.headers["x-request-id"] for r in (r1, r2, r3)]

    codes, ids = run(go())
    assert codes == [200, 401, 404] and ids == ["ok-1", "noauth-2", "missing-3"]
    lines = [r.getMessage() for r in caplog.records if r.name == "stallfree.server.access"]
    assert len(lines) == 3
    for rid, path, code in zip(ids, ("/v1/models", "/v1/models", "/nothing"), codes, strict=True):
        assert any(line.startswith(rid + " ") and f'"GET {path}" {code} ' in line for line in lines), lines
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "msg", None, None)
    token = current_request_id.set("inside-7")
    try:
        RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    assert record.request_id == "inside-7"  # type: ignore[attr-defined]


def test_valid_request_id_bounds():
    """valid_request_id: visible ASCII 1..128 bytes only."""
    assert valid_request_id(b"!~") == "!~"
    assert valid_request_id(b"a\nb") is None and valid_request_id(b"x" * 129) is None
