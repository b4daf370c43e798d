"""A request to a batch subscriber, on a real redis-server: answered, or refused with a log line
that names the cause, never dropped silently."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from eventbus import EventBus

pytestmark = pytest.mark.integration


class Quote(BaseModel):
    n: int


class Price(BaseModel):
    n: int


@pytest.mark.anyio
async def test_a_request_to_a_batch_subscriber_is_answered_or_refused_loudly(
    settings: Any, r: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A request is an ordinary event and "a handler that returns a pydantic model" answers
    it (docs/semantics.md, Request/reply). A batch handler returning one model per event gets
    no reply through, and no log line names the cause. Checked once the batch is handled and
    acked: a reply in the caller's reply stream, or a WARNING of the consumer."""
    import logging

    from support import pending_count, running, wait_until

    from eventbus.request import requester

    s = settings(shards=1)
    bus, caller = EventBus(s), EventBus(s)
    called: list[int] = []

    @bus.subscriber("quotes", group="pricing", batch=True)
    async def price(quotes: list[Quote]) -> list[Price]:
        called.extend(q.n for q in quotes)
        return [Price(n=q.n) for q in quotes]

    caplog.set_level(logging.WARNING)
    stream = bus.keys.stream("quotes", 0)
    async with caller, running(bus), anyio.create_task_group() as tg:
        tg.start_soon(lambda: caller.request("quotes", Quote(n=1), resource_id="r", timeout_s=600))
        await wait_until(lambda: called == [1])

        async def acked() -> bool:
            return await pending_count(r, stream, "pricing") == 0

        await wait_until(acked)
        replies = await r.xlen(requester(caller.redis, caller.keys, "quotes").stream)
        tg.cancel_scope.cancel()
    told = [x for x in caplog.records if x.name.startswith("eventbus.consumer")]
    assert replies or told, "handled and acked: no reply, and no log line says why"
