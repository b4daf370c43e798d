"""Failures leave a traceback: a retry is logged at WARNING and a dead letter at ERROR, both with
the handler's traceback; the dead-letter record keeps a bounded traceback and ``eventbus dlq show``
prints it; every undecodable entry dead-lettered is a WARNING; a failure whose message cannot be
encoded is still dead-lettered and parks its resource."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
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


async def test_a_failure_with_an_unencodable_message_still_parks_the_resource(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Park (semantics.md "Park": "Every later event of that resource in the group is then
    dead-lettered with reason parked, in order").

    `dead_letter_fields` stores ``str(exc).encode()`` (protocol/dead_letters.py), which raises
    `UnicodeEncodeError` for a message with a lone surrogate (text decoded with
    ``surrogateescape``: file names from `os.fsdecode`, bytes from a peer). The error escapes
    `Failures.dead_letter_and_park` before the park; `QueueRunner._settle` takes it for an
    internal error and writes a plain ``failed`` dead letter (of the UnicodeEncodeError, the
    handler's own error lost), acks, and the resource is not parked: x:2 runs while x:1 sits in
    the dead-letter stream, and a requeue by resource finds nothing parked.
    """
    bus = EventBus(settings(shards=1))
    handled: list[int] = []

    @bus.subscriber("t", group="g", on_failure="park", max_attempts=1)
    async def handle(event: Tick) -> None:
        if event.seq == 1:
            raise RuntimeError("cannot open " + b"caf\xe9.txt".decode("utf-8", "surrogateescape"))
        handled.append(event.seq)

    dlq = bus.keys.dead_letter("t", "g")
    async with running(bus):
        for seq in (1, 2):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        # x:2 is settled either way: handled (the bug) or dead-lettered as parked
        await wait_until(lambda: _settled(r, dlq, handled, 2))
        parked = await r.hget(bus.keys.parked("t", "g"), "x")
        letters = await r.xrange(dlq)
    reasons = [fields[b"reason"] for _, fields in letters]
    assert parked is not None and handled == [], (
        f"x was not parked after x:1 failed: x:2 handled={handled}, dead letters {reasons}"
    )


async def _settled(r: Any, dlq: str, handled: list[int], n: int) -> bool:
    return bool(handled) or await r.xlen(dlq) >= n
