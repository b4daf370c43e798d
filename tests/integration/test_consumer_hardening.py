"""Issue 10, consumer side, against a real redis-server: large entries decoded off the event loop
(item 4), authenticated control entries (6), handler timeouts (8), persistent error replies (9),
catch-up backoff (14)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import msgpack
import pytest
import redis.asyncio
import zstandard
from pydantic import BaseModel
from support import Recorder, Tick, running, wait_until

from eventbus import Context, EventBus, Settings
from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE, FORMAT_MSGPACK_ZSTD
from eventbus.dlq import DeadLetters
from eventbus.metrics import METRICS

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]


def dead_letters(bus: EventBus, r: redis.asyncio.Redis, topic: str = "orders") -> DeadLetters:
    return DeadLetters(r, bus.keys, bus.topic(topic), "billing")


async def letters_are(dl: DeadLetters, n: int) -> bool:
    return len(await dl.letters()) == n


# -- item 4: large entries are decoded in a worker thread ------------------------------------------
class Big(BaseModel):
    values: list[int]


def container_bomb(n: int) -> bytes:
    """A valid-looking envelope whose payload is an array of `n` empty arrays: a few hundred
    bytes of zstd that unpack into `n` Python lists (refused past the container budget)."""
    head = b"\x85" + b"".join(
        msgpack.packb(x) for x in ("v", 1, "id", b"x" * 16, "ts", 1, "h", {}, "p")
    )
    body = head + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    return bytes([FORMAT_MSGPACK_ZSTD]) + zstandard.ZstdCompressor().compress(body)


async def test_a_decompression_bomb_does_not_block_heartbeats(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    # 4 MiB payloads: a body may hold 4 M containers, which take seconds to unpack (mostly the
    # garbage collector): on the event loop that would outlive the lease (1.6 s)
    s = settings(shards=1, liveness_ttl_s=2.0, max_payload_bytes=4 << 20)
    bus = EventBus(s)
    rec = Recorder()
    bigs: list[int] = []

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick | Big, ctx: Context) -> None:
        if isinstance(event, Big):
            bigs.append(len(event.values))
        else:
            rec.add(event, ctx)

    lease_lost = METRICS.lease_lost.labels("orders", "billing")
    before = lease_lost._value.get()
    stream = bus.keys.stream("orders", 0)
    await bus.publish("orders", Tick(resource="a", seq=1), resource_id="a")
    await r.xadd(stream, {F_RESOURCE: b"bomb", F_TYPE: b"Big", F_DATA: container_bomb(32 << 20)})
    await bus.publish("orders", Big(values=list(range(300_000))), resource_id="big")
    await bus.publish("orders", Tick(resource="a", seq=2), resource_id="a")
    dl = dead_letters(bus, r)
    longest_gap = 0.0

    async def loop_latency() -> None:
        nonlocal longest_gap
        while True:
            before_tick = time.monotonic()
            await anyio.sleep(0.01)
            longest_gap = max(longest_gap, time.monotonic() - before_tick - 0.01)

    async with running(bus) as runs, anyio.create_task_group() as watch:
        watch.start_soon(loop_latency)
        await wait_until(lambda: letters_are(dl, 1))
        await rec.wait_for(2)
        await wait_until(lambda: bigs == [300_000])
        consumer = runs[0].bus.consumers[0]
        assert list(consumer.table.held) == [0]
        watch.cancel_scope.cancel()
    [letter] = await dl.letters()
    assert (letter.resource_id, letter.reason) == ("bomb", "undecodable")
    assert "decompression bomb" in letter.error
    assert lease_lost._value.get() == before
    # the event loop (heartbeats) never waited for more than a fraction of the lease
    assert longest_gap < s.lease_s / 2, longest_gap


def test_the_consumer_decodes_up_to_the_shared_cap(settings: SettingsFactory) -> None:
    s = settings(max_payload_bytes=1 << 16)
    bus = EventBus(s)

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None: ...

    from eventbus.consumer.handling import Handling
    from eventbus.keys import Keys
    from eventbus.retry import forever

    h = Handling(None, Keys(), s, bus.subscriptions[0], "c", forever(0.01, 0.1))
    assert h.max_decoded_bytes == s.max_decompressed_bytes
