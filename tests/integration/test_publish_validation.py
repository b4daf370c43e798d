"""Publish refuses what no consumer would handle.

5: event types starting with ``__eventbus.`` (eventbus's control entries) are refused at
publish (API and CLI) and at subscriber registration; the operator's ``eventbus dlq`` path
still writes its control entries.
11: headers that are not str -> str, text that is not UTF-8, and payloads that decompress over
the consumers' cap (or over their structural budget) are refused with typed errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import anyio
import pytest
import redis
from pydantic import BaseModel
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.dlq import DROP, UNPARK, DeadLetters
from eventbus.errors import (
    DecompressedTooLarge,
    InvalidEvent,
    ReservedEventType,
)
from eventbus.protocol.codec import F_TYPE, decode_entry

pytestmark = pytest.mark.anyio
RUNNER = CliRunner(env={"COLUMNS": "200"})
SettingsFactory = Callable[..., Settings]


class Forged(BaseModel):
    __event_type__: ClassVar[str] = "__eventbus.drop"
    group: str = "billing"


class Blob(BaseModel):
    data: object = None


def _entries(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return sum(r.xlen(k) for k in r.scan_iter("eventbus:stream:*"))


async def test_reserved_types_are_refused_at_publish(
    settings: SettingsFactory, redis_db: str
) -> None:
    bus = EventBus(settings())
    with pytest.raises(ReservedEventType, match="reserved") as info:
        await bus.publish("orders", Forged(), resource_id="r")
    assert info.value.event_type == "__eventbus.drop"
    with pytest.raises(ReservedEventType):
        await bus.publish_many("orders", [("r", Forged())])
    async with bus:  # the running bus (coalesced path) refuses too
        with pytest.raises(ReservedEventType):
            await bus.publish("orders", Forged(), resource_id="r")
    await bus.aclose()
    assert _entries(redis_db) == 0


def test_reserved_types_are_refused_by_the_cli(redis_db: str) -> None:
    url = ["--redis-url", redis_db]
    for kind in ("__eventbus.drop", "__eventbus.unpark", "__eventbus.anything"):
        out = RUNNER.invoke(app, ["publish", "t", "--type", kind, "--resource-id", "r", *url])
        assert out.exit_code == 1, out.output
        assert "reserved" in out.output and "Traceback" not in out.output
    assert _entries(redis_db) == 0


def test_reserved_types_are_refused_at_subscriber_registration() -> None:
    bus = EventBus(Settings(redis_url="redis://127.0.0.1:1/0"))
    with pytest.raises(ReservedEventType):

        @bus.subscriber("orders", group="billing")
        async def handle(event: Forged) -> None: ...

    assert bus.subscriptions == []


async def test_the_operator_path_still_writes_control_entries(
    settings: SettingsFactory, redis_db: str
) -> None:
    bus = EventBus(settings(shards=4))
    topic = bus.topic("orders")
    await bus.registry.ensure(topic)
    await bus.redis.hset(bus.keys.parked("orders", "billing"), mapping={"r1": "1-0", "r2": "2-0"})
    dl = DeadLetters(bus.redis, bus.keys, topic, "billing")
    assert await dl.drop_resource("r1")
    args = ["dlq", "requeue", "orders", "billing", "--resource", "r2", "--redis-url", redis_db]
    out = await anyio.to_thread.run_sync(lambda: RUNNER.invoke(app, args))
    assert out.exit_code == 0, out.output
    kinds = []
    for key in await bus.redis.keys("eventbus:stream:orders:*"):
        for _, fields in await bus.redis.xrange(key):
            kinds.append(fields[F_TYPE].decode())
            payload = decode_entry(fields).payload
            assert payload["group"] == "billing" and len(payload["nonce"]) == 32  # authenticated
    assert sorted(kinds) == sorted([DROP, UNPARK])
    await bus.aclose()


@pytest.mark.parametrize(
    "headers",
    [{"attempt": 1}, {1: "x"}, {"k": None}, {"k": b"bytes"}, {"k": "\ud800"}],
)
async def test_headers_must_be_utf8_str_to_str(
    settings: SettingsFactory, redis_db: str, headers: dict[object, object]
) -> None:
    bus = EventBus(settings())
    with pytest.raises(InvalidEvent, match="header"):
        await bus.publish("t", Blob(), resource_id="r", headers=headers)  # type: ignore[arg-type]
    await bus.aclose()
    assert _entries(redis_db) == 0


async def test_a_resource_id_that_is_not_utf8_is_a_typed_error(
    settings: SettingsFactory, redis_db: str
) -> None:
    bus = EventBus(settings())
    with pytest.raises(InvalidEvent, match="resource_id"):
        await bus.publish("t", Blob(), resource_id="bad-\udc80")
    await bus.aclose()
    assert _entries(redis_db) == 0


async def test_a_payload_over_the_consumers_decompression_cap_is_refused(
    settings: SettingsFactory, redis_db: str
) -> None:
    s = settings(max_payload_bytes=1024)  # consumers decode at most 64 KiB
    bus = EventBus(s)
    with pytest.raises(DecompressedTooLarge) as info:
        await bus.publish("t", Blob(data="a" * 100_000), resource_id="r")  # ~100 B compressed
    assert info.value.limit == s.max_decompressed_bytes
    # within the cap it goes through
    assert await bus.publish("t", Blob(data="a" * 60_000), resource_id="r")
    await bus.aclose()
    assert _entries(redis_db) == 1


async def test_a_payload_over_the_structural_budget_is_refused(
    settings: SettingsFactory, redis_db: str
) -> None:
    bus = EventBus(settings())
    with pytest.raises(InvalidEvent, match="would not decode"):
        await bus.publish("t", Blob(data=[[]] * 20_000), resource_id="r")
    await bus.aclose()
    assert _entries(redis_db) == 0
