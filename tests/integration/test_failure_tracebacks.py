"""Failures leave a traceback (issue 11 item 3): a retry is logged at WARNING and a dead letter
at ERROR, both with the handler's traceback; the dead-letter record keeps a bounded traceback
and ``eventbus dlq show`` prints it; every undecodable entry dead-lettered is a WARNING."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import anyio
import pytest
from support import Tick, running, wait_until
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.protocol.codec import F_RESOURCE, F_TYPE

pytestmark = pytest.mark.anyio


def _charge(total: int) -> None:
    raise ValueError(f"card declined for {total}")


async def test_failures_are_logged_and_dead_lettered_with_their_traceback(
    settings: Callable[..., Settings], redis_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = EventBus(settings(shards=1, max_attempts=2))

    @bus.subscriber("orders", group="billing")
    async def on_order(event: Tick) -> None:
        _charge(event.seq)

    await bus.publish("orders", Tick(resource="o1", seq=42), resource_id="o1")
    stream = bus.keys.stream("orders", 0)
    await bus.redis.xadd(stream, {F_RESOURCE: b"o1", F_TYPE: b"Tick", F_DATA_BAD: b"\x01\xc1"})
    await bus.redis.xadd(stream, {b"junk": b"x"})
    dlq = bus.keys.dead_letter("orders", "billing")
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        async with running(bus):
            await wait_until(lambda: _xlen_is(bus, dlq, 3))

    retry = [r for r in caplog.records if "attempt 1/2" in r.getMessage()]
    dead = [r for r in caplog.records if "dead-lettering" in r.getMessage()]
    assert [r.levelno for r in retry] == [logging.WARNING]
    assert [r.levelno for r in dead] == [logging.ERROR]
    for record in (*retry, *dead):
        assert record.exc_info is not None and record.exc_info[0] is ValueError
        text = logging.Formatter().format(record)
        assert "Traceback (most recent call last)" in text and "in _charge" in text
    undecodable = [r for r in caplog.records if "undecodable, dead-lettered" in r.getMessage()]
    assert len(undecodable) == 2 and all(r.levelno == logging.WARNING for r in undecodable)

    [(dlq_id, letter)] = [
        (i, f) for i, f in await bus.redis.xrange(dlq) if f[b"reason"] == b"failed"
    ]
    assert b"in _charge" in letter[b"traceback"]
    assert letter[b"traceback"].endswith(b"ValueError: card declined for 42\n")
    out = await anyio.to_thread.run_sync(
        lambda: CliRunner().invoke(
            app, ["dlq", "show", "orders", "billing", dlq_id.decode(), "--redis-url", redis_db]
        )
    )
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)
    assert shown["traceback"][0] == "Traceback (most recent call last):"
    assert shown["traceback"][-1] == "ValueError: card declined for 42"
    assert any("in _charge" in line for line in shown["traceback"])
    await bus.aclose()


F_DATA_BAD = b"data"


async def _xlen_is(bus: EventBus, key: str, n: int) -> bool:
    return int(await bus.redis.xlen(key)) == n
