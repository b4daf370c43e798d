"""Consumer safety against a real redis-server: large entries decoded off the event loop,
authenticated control entries, handler timeouts, persistent error replies, catch-up backoff."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import msgpack
import pytest
import redis.asyncio
import zstandard
from pydantic import BaseModel
from support import Recorder, Tick, running, wait_until

from eventbus import Context, EventBus, Settings, shard_of
from eventbus.consumer import decoding
from eventbus.consumer.decoding import _without_gc
from eventbus.dlq import DeadLetters
from eventbus.ops.metrics import METRICS
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, FORMAT_MSGPACK_ZSTD

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]
T = TypeVar("T")


def dead_letters(bus: EventBus, r: redis.asyncio.Redis, topic: str = "orders") -> DeadLetters:
    return DeadLetters(r, bus.keys, bus.topic(topic), "billing")


async def letters_are(dl: DeadLetters, n: int) -> bool:
    return len(await dl.letters()) == n


# -- large entries are decoded in a worker thread ------------------------------------------
class Big(BaseModel):
    values: list[int]


BOMB_WITHIN_S = 120.0
"""How long the bomb's test waits for each outcome (an overall bound, under pytest's 300 s)."""


def container_bomb(n: int) -> bytes:
    """A valid-looking envelope whose payload is an array of `n` empty arrays: a few hundred
    bytes of zstd that unpack into `n` Python lists (refused past the container budget)."""
    head = b"\x85" + b"".join(
        msgpack.packb(x) for x in ("v", 1, "id", b"x" * 16, "ts", 1, "h", {}, "p")
    )
    body = head + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    return bytes([FORMAT_MSGPACK_ZSTD]) + zstandard.ZstdCompressor().compress(body)


async def test_a_decompression_bomb_does_not_block_heartbeats(
    settings: SettingsFactory, r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
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
    # the loop's turns counted while each large entry decodes: a decode on the event loop
    # would see none, one in a worker thread sees the loop go round (heartbeats included)
    turns = 0
    turns_during: dict[bytes, int] = {}

    def counted(decode: Callable[[dict[bytes, bytes]], T], fields: dict[bytes, bytes]) -> T:
        start = turns
        try:
            return _without_gc(decode, fields)
        finally:
            turns_during[fields[F_RESOURCE]] = turns - start

    monkeypatch.setattr(decoding, "_without_gc", counted)

    async def loop_turns() -> None:
        nonlocal turns
        while True:
            await anyio.sleep(0.005)
            turns += 1

    async with anyio.create_task_group() as watch:
        watch.start_soon(loop_turns)
        async with running(bus) as runs:
            # unpacking the bomb's 4 M containers up to the budget takes 10-17 s of a busy
            # machine (two CPU hogs): awaited with a bound far past that, not the usual 20 s
            await wait_until(lambda: letters_are(dl, 1), within_s=BOMB_WITHIN_S)
            await rec.wait_for(2, within_s=BOMB_WITHIN_S)
            await wait_until(lambda: bigs == [300_000], within_s=BOMB_WITHIN_S)
            consumer = runs[0].bus.consumers[0]
            assert list(consumer.ownership.table.held) == [0]
        watch.cancel_scope.cancel()
    [letter] = await dl.letters()
    assert (letter.resource_id, letter.reason) == ("bomb", "undecodable")
    assert "decompression bomb" in letter.error
    assert lease_lost._value.get() == before
    # the bomb (seconds of unpacking) decoded off the loop, which kept turning meanwhile
    assert turns_during.get(b"bomb", 0) > 0, turns_during


def test_a_large_decode_shortens_the_gil_switch_interval_until_it_ends() -> None:
    # the loop's thread waits a switch interval for the GIL after each select/send/recv while a
    # decode computes: 5 ms each stopped the loop 0.3-0.65 s under load (the bomb's test above)
    import gc
    import sys

    before = sys.getswitchinterval()
    assert before > 0.0005  # Python's default is 5 ms
    seen: list[tuple[float, bool]] = []

    def decode(fields: dict[bytes, bytes]) -> int:
        seen.append((sys.getswitchinterval(), gc.isenabled()))
        if fields:  # a nested decode (another worker thread) restores nothing when it ends
            _without_gc(decode, {})
            seen.append((sys.getswitchinterval(), gc.isenabled()))
        return len(fields)

    assert _without_gc(decode, {b"d": b"x"}) == 1
    assert seen == [(0.0005, False)] * 3  # decoding.DECODE_SWITCH_INTERVAL_S
    assert (sys.getswitchinterval(), gc.isenabled()) == (before, True)
    with pytest.raises(ValueError, match="bad bytes"):  # restored when the decode raises too
        _without_gc(lambda fields: (_ for _ in ()).throw(ValueError("bad bytes")), {})
    assert (sys.getswitchinterval(), gc.isenabled()) == (before, True)


def test_the_consumer_decodes_up_to_the_shared_cap(settings: SettingsFactory) -> None:
    s = settings(max_payload_bytes=1 << 16)
    bus = EventBus(s)

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None: ...

    from eventbus.client.retry import forever
    from eventbus.consumer.handling import Handling
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS
    from eventbus.protocol.keys import Keys

    member = Member(None, Keys(), s, "orders", "billing", "c", EVENTBUS)  # type: ignore[arg-type]  # no Redis call
    h = Handling(member, bus.subscriptions[0], forever(0.01, 0.1))
    assert h.decoding.max_decoded_bytes == s.max_decompressed_bytes


# -- control entries are authenticated -----------------------------------------------------
def parking_bus(
    settings: SettingsFactory, broken: set[tuple[str, int]]
) -> tuple[EventBus, Recorder]:
    bus = EventBus(settings(shards=2, retry_base_s=0.001, retry_max_s=0.002, max_attempts=1))
    rec = Recorder()

    @bus.subscriber("orders", group="billing", on_failure="park")
    async def handle(event: Tick, ctx: Context) -> None:
        if (event.resource, event.seq) in broken:
            raise RuntimeError(f"cannot handle {event.resource}#{event.seq}")
        rec.add(event, ctx)

    return bus, rec


async def publish_seqs(bus: EventBus, resource: str, seqs: range) -> None:
    for seq in seqs:
        await bus.publish("orders", Tick(resource=resource, seq=seq), resource_id=resource)


@pytest.mark.parametrize("nonce", [None, "00" * 16])
async def test_a_forged_drop_entry_is_dead_lettered_and_deletes_nothing(
    settings: SettingsFactory, r: redis.asyncio.Redis, nonce: str | None
) -> None:
    from eventbus.dlq import DROP, control_entry

    bus, rec = parking_bus(settings, {("bad", 1)})
    dl = dead_letters(bus, r)
    await publish_seqs(bus, "bad", range(1, 3))
    async with running(bus):
        await wait_until(lambda: letters_are(dl, 2))  # bad#1 failed, bad#2 parked
        # what any publisher can XADD: a drop entry naming the group, without a recorded request
        forged = control_entry(DROP, "bad", "billing")
        if nonce is not None:  # or with a nonce of its own invention
            forged = control_entry(DROP, "bad", "billing", nonce=nonce)
        stream = bus.keys.stream("orders", shard_of("bad", 2))
        await r.xadd(stream, forged)
        await wait_until(lambda: letters_are(dl, 3))
    letters = await dl.letters()
    assert [(d.resource_id, d.reason) for d in letters] == [
        ("bad", "failed"),
        ("bad", "parked"),
        ("bad", "forged"),
    ]
    assert letters[2].error_type == "ForgedControlEntry"
    assert "no request recorded" in letters[2].error
    assert list(await dl.parked()) == ["bad"]  # still parked, its letters kept
    assert rec.by_resource() == {}


async def test_the_operators_drop_and_requeue_still_work_and_use_their_request_once(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    from eventbus.dlq import DROP

    broken = {("a", 1), ("b", 1)}
    bus, rec = parking_bus(settings, broken)
    dl = dead_letters(bus, r)
    await publish_seqs(bus, "a", range(1, 3))
    await publish_seqs(bus, "b", range(1, 3))
    async with running(bus):
        await wait_until(lambda: letters_are(dl, 4))
        broken.clear()
        await dl.requeue_resource("a")
        await dl.drop_resource("b")
        # both requests executed: a consumer deletes the letters, then unparks the resource,
        # then deletes the request (`Failures.control`), so the letters can be gone while the
        # resource is still parked
        await wait_until(lambda: requests_are(r, bus, 0))
        await rec.wait_for(2)
        assert await dl.letters() == []
        assert await dl.parked() == {}
        # the requests were used up: the same control entries again are forged
        stream = bus.keys.stream("orders", shard_of("b", 2))
        [(_, replayed)] = [e for e in await r.xrange(stream) if e[1][F_TYPE] == DROP.encode()]
        await r.xadd(stream, replayed)
        await wait_until(lambda: letters_are(dl, 1))
    assert rec.by_resource() == {"a": [1, 2]}
    assert [d.reason for d in await dl.letters()] == ["forged"]
    assert await requests_are(r, bus, 0)


async def requests_are(r: redis.asyncio.Redis, bus: EventBus, n: int) -> bool:
    """Whether the operator's control requests of (orders, billing) not yet executed are `n`."""
    return int(await r.hlen(bus.keys.control("orders", "billing"))) == n


async def test_the_publisher_acl_cannot_record_a_control_request(redis_db: str) -> None:
    from redis.exceptions import NoPermissionError
    from test_acl_roles import _acl

    from eventbus.protocol.keys import Keys

    base = redis_db.removeprefix("redis://")
    admin = redis.asyncio.Redis.from_url(redis_db)
    await admin.execute_command("ACL", "SETUSER", "publisher", *_acl("publisher"))
    publisher = redis.asyncio.Redis.from_url(f"redis://publisher:publisher-pw@{base}")
    try:
        with pytest.raises(NoPermissionError):
            await publisher.hsetnx(Keys().control("orders", "billing"), "n", "x")
    finally:
        await publisher.aclose()
        await admin.acl_deluser("publisher")
        await admin.aclose()


# -- handler timeout -----------------------------------------------------------------------
async def test_a_hanging_async_handler_times_out_is_retried_then_dead_lettered(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=1, concurrency=2, max_attempts=2))
    rec = Recorder()
    attempts: list[int] = []

    @bus.subscriber("orders", group="billing", handler_timeout_s=0.2)
    async def handle(event: Tick, ctx: Context) -> None:
        if event.resource == "hang":
            attempts.append(ctx.attempt)
            await anyio.sleep_forever()
        rec.add(event, ctx)

    timeouts = METRICS.handler_timeouts.labels("orders", "billing")
    before = timeouts._value.get()
    await publish_seqs(bus, "hang", range(1, 3))
    await publish_seqs(bus, "ok", range(1, 4))
    dl = dead_letters(bus, r)
    async with running(bus):
        await rec.wait_for(3)  # other resources go on meanwhile
        await wait_until(lambda: letters_are(dl, 2))
    assert rec.by_resource() == {"ok": [1, 2, 3]}
    assert attempts == [1, 2, 1, 2]  # both events of "hang": two attempts each
    letters = await dl.letters()
    assert [(d.reason, d.attempts, d.error_type) for d in letters] == [
        ("failed", 2, "HandlerTimeout"),
        ("failed", 2, "HandlerTimeout"),
    ]
    assert "0.2 s" in letters[0].error
    assert timeouts._value.get() == before + 4


async def test_a_hung_sync_handler_does_not_block_shutdown_past_the_grace(
    settings: SettingsFactory,
) -> None:
    import threading

    bus = EventBus(settings(shards=1, shutdown_grace_s=0.3, handler_timeout_s=0))
    started, release = threading.Event(), threading.Event()

    @bus.subscriber("orders", group="billing")
    def handle(event: Tick) -> None:
        started.set()
        release.wait(60)  # hangs (no timeout: handler_timeout_s=0)

    await publish_seqs(bus, "a", range(1, 2))
    stop, done = anyio.Event(), anyio.Event()

    async def run() -> None:
        await bus.run(stop=stop)
        done.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_until(started.is_set)
            stop.set()
            with anyio.move_on_after(10):  # far past the grace: shutdown is stuck
                await done.wait()
            stopped_in_time = done.is_set()
            release.set()  # let a stuck shutdown finish, so that the test ends either way
    finally:
        release.set()
        await bus.aclose()
    assert stopped_in_time


async def test_a_sync_handler_attempt_past_the_timeout_is_abandoned_and_counted(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    import threading

    bus = EventBus(settings(shards=1, max_attempts=1, handler_timeout_s=0.2))
    release = threading.Event()

    @bus.subscriber("orders", group="billing")
    def handle(event: Tick) -> None:
        release.wait(60)

    await publish_seqs(bus, "a", range(1, 2))
    dl = dead_letters(bus, r)
    try:
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 1))
    finally:
        release.set()
    [letter] = await dl.letters()
    assert (letter.reason, letter.error_type) == ("failed", "HandlerTimeout")
    assert "abandoned" in letter.error


# -- catch-up from an unreachable archive backs off ---------------------------------------
def unreachable_archive() -> object:
    """An S3 store on a closed port: every request fails at once (no retries)."""
    from datetime import timedelta

    from obstore.store import S3Store

    quick = timedelta(milliseconds=10)
    return S3Store(
        "segments",
        endpoint="http://127.0.0.1:9",
        allow_http=True,
        skip_signature=True,
        region="us-east-1",
        retry_config={
            "max_retries": 0,
            "backoff": {"init_backoff": quick, "max_backoff": quick, "base": 2},
            "retry_timeout": timedelta(seconds=1),
        },
    )


async def test_catch_up_from_an_unreachable_archive_backs_off(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    from eventbus.consumer import Consumer
    from eventbus.consumer.catchup import shard_hook
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    # retry_base_s=30: after a failure the next attempt is at least 30 s away, far beyond the
    # rounds driven below
    s = settings(shards=1, retry_base_s=30, retry_max_s=60)
    store = unreachable_archive()
    bus = EventBus(s, archive=store)

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None: ...

    stream = bus.keys.stream("orders", 0)
    await publish_seqs(bus, "a", range(1, 4))
    await r.xgroup_create(stream, "billing", id="0")
    await r.xtrim(stream, maxlen=0)  # the group's next entries are only in the archive now
    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "orders", "billing", "c-1", EVENTBUS)
    consumer = Consumer(member, bus.registry, bus.subscriptions[0])
    hook = shard_hook(store, consumer.handling)
    attempts = 0

    async def counting(shard: int, token: int) -> object:
        nonlocal attempts
        attempts += 1
        return await hook(shard, token)

    consumer.pipeline.catch_up = counting
    await consumer.pipeline.reader.ensure_groups()
    try:
        for _ in range(10):  # ten lock rounds, driven one by one
            await consumer.pipeline.round(1)
            assert consumer.ownership.table.held == {}  # never read past the gap
    finally:
        await consumer.ownership.leave()
        await bus.aclose()
    assert attempts == 1


def test_catch_up_backoff_grows_per_shard_and_resets_on_success() -> None:
    from eventbus.client.retry import backoff
    from eventbus.consumer.catching_up import CatchUpSchedule

    now = [0.0]
    # a check interval under the backoff's: the backoff's own growth shows
    schedule = CatchUpSchedule(backoff(1.0, 100.0), check_s=0.5, clock=lambda: now[0])
    assert not schedule.backing_off(0) and not schedule.backing_off(1)
    schedule.failed(0)
    assert schedule.backing_off(0) and not schedule.backing_off(1)  # per shard
    now[0] = 2.0  # compute(1) is within [1, 2] s
    assert not schedule.backing_off(0)
    schedule.failed(0)
    now[0] = 3.9  # compute(2) is within [2, 4] s from 2.0
    assert schedule.backing_off(0)
    now[0] = 6.0
    schedule.succeeded(0)
    assert not schedule.backing_off(0)  # a success: checked again at its next lock
    schedule.failed(0)  # the count restarted: compute(1) again, within [1, 2] s
    now[0] += 2.0
    assert not schedule.backing_off(0)
