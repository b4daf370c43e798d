"""Error replies inside pipelines keep the server's reason: redis-py's own message for a pipeline's
first error is a template it never fills in ("Command # 1 (...) of pipeline caused error:
{exception.args}"); eventbus raises the reply's own `ResponseError`
(`eventbus.client.pipelines.execute`). On a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from redis.exceptions import ResponseError

from eventbus.protocol.codec import Envelope
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import CORRELATION_ID, REPLY_TO, send_reply
from eventbus.protocol.retention import acked_point

pytestmark = pytest.mark.anyio


class Answer(BaseModel):
    ok: bool


async def test_a_refused_reply_names_the_servers_reason(r: Any) -> None:
    keys = Keys()
    stream = keys.reply("q", "0" * 32)
    await r.set(stream, "not a stream")  # XADD on it: WRONGTYPE
    request = Envelope("a", "Q", b"\1" * 16, 0, {REPLY_TO: stream, CORRELATION_ID: "c1"})
    with pytest.raises(ResponseError) as caught:
        await send_reply(r, keys, "q", 0, "1-0", request, Answer(ok=True))
    assert str(caught.value).startswith("WRONGTYPE"), str(caught.value)


async def test_retention_reports_the_servers_reason(r: Any, monkeypatch: Any) -> None:
    """XPENDING of a group that vanished between XINFO GROUPS and the pipeline: NOGROUP."""
    stream = "s:retention"
    await r.xadd(stream, {"k": "v"})
    await r.xgroup_create(stream, "g", id="0")
    groups = await r.xinfo_groups(stream)
    await r.xgroup_destroy(stream, "g")

    async def stale(_: str) -> Any:
        return groups

    monkeypatch.setattr(r, "xinfo_groups", stale)
    with pytest.raises(ResponseError) as caught:
        await acked_point(r, stream)
    assert str(caught.value).startswith("NOGROUP"), str(caught.value)
