"""Catch-up handles entries as the live consumer does.

Each test archives a group's backlog (the group exists, nobody reads it, the offloader archives
and trims it), then catches the group up, either standalone (`eventbus.tier.catch_up`) or inside
a live consumer (`EventBus(archive=store)` + `bus.run`), and expects what the live path promises
(docs/semantics.md): park, fencing, the dedup window, the subscriber's retry delays, control
entries, and validators raising anything. Public API only: the internals are being rewritten.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import pytest
from pydantic import BaseModel, model_validator
from support import async_client
from tier_support import fast_tier, wait_until

from eventbus import Context, EventBus, Settings
from eventbus.dlq import DeadLetter, DeadLetters
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.tier import LockUnavailable, catch_up, offload_until_caught_up, open_store
from eventbus.tier.store import Store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TOPIC, GROUP = "orders", "billing"
MODES = ["standalone", "live"]  # catch_up(...) / the live consumer's hook (EventBus(archive=...))


class Tick(BaseModel):
    resource: str
    seq: int


class Code(BaseModel):
    """A model whose validator raises KeyError, which pydantic does not wrap in ValidationError."""

    resource: str
    code: str

    @model_validator(mode="after")
    def known(self) -> Code:
        if self.code == "boom":
            raise KeyError(self.code)
        return self


# -- helpers ----------------------------------------------------------------------------------


@dataclass
class Recorder:
    """What the handler saw: (resource, seq, fencing token), in call order."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, resource: str, seq: int, ctx: Context) -> None:
        self.calls.append((resource, seq, ctx.fencing_token))

    def by_resource(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for rid, seq, _ in self.calls:
            out[rid].append(seq)
        return dict(out)

    def saw(self, resource: str, seq: int) -> bool:
        return any((rid, s) == (resource, seq) for rid, s, _ in self.calls)


def settings_for(redis_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "shards": 1,
        "block_max_ms": 50,
        "idle_release_ms": 60_000,  # the live consumer keeps its shard
        "retry_base_s": 0.001,
        "retry_max_s": 0.002,
    }
    values.update(overrides)
    return Settings(**values)


def tick_bus(
    settings: Settings,
    rec: Recorder,
    *,
    archive: Store | None = None,
    broken: set[tuple[str, int]] | None = None,
    **sub: Any,
) -> EventBus:
    """A bus whose `TOPIC`/`GROUP` handler records Ticks and raises for pairs in `broken`."""
    bus = EventBus(settings, archive=archive)
    failing = broken if broken is not None else set()

    @bus.subscriber(TOPIC, group=GROUP, **sub)
    async def handle(event: Tick, ctx: Context) -> None:
        if (event.resource, event.seq) in failing:
            raise RuntimeError(f"cannot handle {event.resource}#{event.seq}")
        rec.add(event.resource, event.seq, ctx)

    return bus


async def create_group(bus: EventBus) -> None:
    """The group exists from the start (reading from the first entry) but nobody reads."""
    await bus.redis.xgroup_create(bus.keys.stream(TOPIC, 0), GROUP, id="0", mkstream=True)


async def publish(bus: EventBus, resource: str, seqs: range) -> list[str]:
    return [
        await bus.publish(TOPIC, Tick(resource=resource, seq=s), resource_id=resource) for s in seqs
    ]


async def archive_backlog(bus: EventBus, store: Store) -> None:
    """Archive the stream and trim it: the group's next entries now exist only in segments."""
    await offload_until_caught_up(
        bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=60
    )
    stream = bus.keys.stream(TOPIC, 0)
    first = (await bus.redis.xinfo_stream(stream))["first-entry"]
    (group,) = [g for g in await bus.redis.xinfo_groups(stream) if g["name"] == GROUP.encode()]
    delivered = group["last-delivered-id"].decode()
    assert first is None or _id(first[0].decode()) > _id(delivered), "nothing was trimmed"


def _id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def dead_letters(bus: EventBus) -> DeadLetters:
    return DeadLetters(bus.redis, bus.keys, bus.topic(TOPIC), GROUP)


async def letters_of(bus: EventBus) -> list[DeadLetter]:
    return await dead_letters(bus).letters()


@contextlib.asynccontextmanager
async def running(bus: EventBus) -> AsyncIterator[None]:
    """Run `bus` (already entered) in the background; stop it on exit."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(bus.run, stop=stop))
        yield
        stop.set()


async def run_catch_up(
    mode: str, bus: EventBus, store: Store, done: Callable[[], Awaitable[bool] | bool]
) -> None:
    """Catch `GROUP` up: standalone with `catch_up`, or by running `bus` (built with
    ``archive=store``) until `done()` holds."""
    if mode == "standalone":
        with anyio.fail_after(30):
            await catch_up(bus, store, TOPIC, GROUP)
    else:
        async with running(bus):
            await wait_until(done, within_s=20)


# -- 1. on_failure="park" ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_park_holds_the_resource_back_during_catch_up(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    """After a failure (attempts exhausted) the resource's later events are dead-lettered as
    parked, in order, without being handled; other resources go on."""
    store = open_store(str(tmp_path / "segments"))
    rec = Recorder()
    settings = settings_for(redis_db)
    bus = tick_bus(
        settings,
        rec,
        archive=store if mode == "live" else None,
        broken={("bad", 2)},
        on_failure="park",
        max_attempts=2,
    )
    async with bus:
        await create_group(bus)
        bad = await publish(bus, "bad", range(1, 5))
        await publish(bus, "good", range(1, 4))
        await archive_backlog(bus, store)

        async def settled() -> bool:  # every archived event handled or dead-lettered
            return len(rec.calls) + len(await letters_of(bus)) >= 7

        await run_catch_up(mode, bus, store, settled)
        letters = await letters_of(bus)
        parked = await dead_letters(bus).parked()
    assert rec.by_resource() == {"bad": [1], "good": [1, 2, 3]}, "a parked resource went on"
    assert [(d.resource_id, d.entry_id, d.reason) for d in letters] == [
        ("bad", bad[1], "failed"),
        ("bad", bad[2], "parked"),
        ("bad", bad[3], "parked"),
    ]
    assert list(parked) == ["bad"]


# -- 2. fencing -------------------------------------------------------------------------------


@dataclass
class Takeover:
    """Another member of the group takes a shard's lock from a thread of its own, as soon as the
    current owner's liveness has lapsed; `done` is set once it holds the lock (or gave up)."""

    redis_url: str
    bus: EventBus
    shard: int = 0
    token: int | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            anyio.run(self._take)
        finally:
            self.done.set()

    async def _take(self) -> None:
        client = async_client(self.redis_url)
        settings = Settings(liveness_ttl_s=60)
        lock = LockClient(
            Member(client, self.bus.keys, settings, TOPIC, GROUP, "intruder", EVENTBUS), shards=1
        )
        try:

            async def taken() -> bool:
                grant = (await lock.acquire([self.shard])).grants.get(self.shard)
                self.token = grant.token if grant else None
                return grant is not None

            await wait_until(taken, within_s=20)
        finally:
            await client.aclose()


async def test_catch_up_starts_no_handler_with_a_superseded_token(
    redis_db: str, tmp_path: Any
) -> None:
    """The catch-up's process pauses in a handler (it blocks the event loop, so no heartbeat
    runs either) past its liveness TTL, and another member takes the shard's lock meanwhile.
    Woken up, the catch-up must start no further handler with its superseded token, and ack (or
    move the group past) nothing."""
    store = open_store(str(tmp_path / "segments"))
    bus = EventBus(settings_for(redis_db, liveness_ttl_s=2))
    takeover = Takeover(redis_db, bus)
    calls: list[tuple[int, int, bool]] = []  # seq, token, started after the takeover

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick, ctx: Context) -> None:
        calls.append((event.seq, ctx.fencing_token, takeover.done.is_set()))
        if event.seq == 1:  # a process pause: the whole event loop stops until the takeover
            takeover.start()
            takeover.done.wait(timeout=30)

    async with bus:
        await create_group(bus)
        for seq in range(1, 4):  # three resources: nothing but the lock holds 2 and 3 back
            await bus.publish(TOPIC, Tick(resource=f"r{seq}", seq=seq), resource_id=f"r{seq}")
        await archive_backlog(bus, store)
        with anyio.fail_after(60), contextlib.suppress(LockUnavailable):  # the intruder's now
            await catch_up(bus, store, TOPIC, GROUP, lock_timeout_s=1)
        stream = bus.keys.stream(TOPIC, 0)
        (group,) = await bus.redis.xinfo_groups(stream)
        pending = await bus.redis.xpending(stream, GROUP)
    assert takeover.token is not None, "the other member never got the lock"
    assert calls[0][:2] == (1, takeover.token - 1)
    stale = [(seq, token) for seq, token, after in calls if after and token < takeover.token]
    assert stale == [], f"handlers started with a superseded token (current {takeover.token})"
    assert group["last-delivered-id"] == b"0-0", "the fenced catch-up moved the group"
    assert pending["pending"] == 0, "the fenced catch-up left entries pending"


# -- 3. dedup_window_s ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_dedup_window_skips_an_event_id_met_again_in_catch_up(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    """Two entries carry the same event ID (an ambiguous publish retried): the second is skipped."""
    store = open_store(str(tmp_path / "segments"))
    rec = Recorder()
    bus = tick_bus(
        settings_for(redis_db),
        rec,
        archive=store if mode == "live" else None,
        dedup_window_s=60,
    )
    async with bus:
        await create_group(bus)
        await publish(bus, "x", range(1, 2))
        stream = bus.keys.stream(TOPIC, 0)
        ((_, fields),) = await bus.redis.xrange(stream)
        await bus.redis.xadd(stream, fields)  # the same event (same event ID) again
        await publish(bus, "x", range(2, 3))
        await archive_backlog(bus, store)
        await publish(bus, "x", range(3, 4))  # in Redis: handled after the archived ones
        await run_catch_up(mode, bus, store, lambda: rec.saw("x", 3))
    assert rec.by_resource() == {"x": [1, 2, 3]}, "the duplicate event ID was handled again"


async def test_dedup_window_skips_in_catch_up_an_event_id_handled_live(
    redis_db: str, tmp_path: Any
) -> None:
    """An event handled by the live consumer, then met again (a copy) in an archived backlog:
    the window spans both paths, so the catch-up skips it."""
    store = open_store(str(tmp_path / "segments"))
    rec = Recorder()
    settings = settings_for(redis_db)
    live = tick_bus(settings, rec, dedup_window_s=60)
    stream = live.keys.stream(TOPIC, 0)
    async with live:
        await create_group(live)
        (first,) = await publish(live, "x", range(1, 2))

        async def acked() -> bool:  # handled, remembered, acked
            return (await live.redis.xpending(stream, GROUP))["pending"] == 0 and any(
                g["last-delivered-id"] == first.encode()
                for g in await live.redis.xinfo_groups(stream)
            )

        async with running(live):
            await wait_until(lambda: rec.saw("x", 1))
            await wait_until(acked)
    bus = tick_bus(settings, rec, dedup_window_s=60)
    async with bus:
        ((_, fields),) = await bus.redis.xrange(stream)
        await bus.redis.xadd(stream, fields)  # the same event (same event ID) again
        await publish(bus, "x", range(2, 3))
        await archive_backlog(bus, store)
        with anyio.fail_after(30):
            await catch_up(bus, store, TOPIC, GROUP)
    assert rec.by_resource() == {"x": [1, 2]}, "an event ID handled live was handled again"


# -- 4. the subscriber's retry delays ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_catch_up_retries_with_the_subscribers_delays(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    """The settings say wait a minute between attempts, the subscriber says a millisecond: the
    subscriber's delays apply, so two failures then a success take far less than a minute."""
    store = open_store(str(tmp_path / "segments"))
    settings = settings_for(redis_db, retry_base_s=60, retry_max_s=120)
    bus = EventBus(settings, archive=store if mode == "live" else None)
    attempts: list[int] = []

    @bus.subscriber(TOPIC, group=GROUP, max_attempts=3, retry_base_s=0.001, retry_max_s=0.002)
    async def handle(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("transient")

    async with bus:
        await create_group(bus)
        await publish(bus, "r", range(1, 2))
        await archive_backlog(bus, store)
        with anyio.fail_after(15):  # the settings' delays would take 30 s at least
            if mode == "standalone":
                await catch_up(bus, store, TOPIC, GROUP)
            else:
                async with running(bus):
                    await wait_until(lambda: 3 in attempts, within_s=15)
        letters = await letters_of(bus)
    assert attempts == [1, 2, 3]
    assert letters == []


# -- 5. control entries -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "mode"), [("requeue", "standalone"), ("drop", "standalone"), ("requeue", "live")]
)
async def test_control_entries_met_in_catch_up_are_executed(
    redis_db: str, tmp_path: Any, kind: str, mode: str
) -> None:
    """A resource parked by the live consumer; the operator requeues (or drops) it, and one more
    event of it follows; all of that is archived and trimmed before the group reads it. The
    catch-up executes the control entry (replays or drops the letters, unparks the resource)
    instead of dead-lettering it, then handles the later event."""
    store = open_store(str(tmp_path / "segments"))
    rec = Recorder()
    broken = {("bad", 1)}
    settings = settings_for(redis_db)
    parker = tick_bus(settings, rec, broken=broken, on_failure="park", max_attempts=1)
    async with parker:
        await create_group(parker)
        await publish(parker, "bad", range(1, 4))

        async def all_dead_lettered() -> bool:
            return len(await letters_of(parker)) == 3

        async with running(parker):
            await wait_until(all_dead_lettered)
        assert rec.calls == [] and list(await dead_letters(parker).parked()) == ["bad"]

    broken.clear()  # the operator fixed the cause
    bus = tick_bus(
        settings,
        rec,
        archive=store if mode == "live" else None,
        broken=broken,
        on_failure="park",
        max_attempts=1,
    )
    async with bus:
        dl = dead_letters(bus)
        if kind == "requeue":
            await dl.requeue_resource("bad")
        else:
            await dl.drop_resource("bad")
        await publish(bus, "bad", range(4, 5))  # published after the request
        await archive_backlog(bus, store)
        await run_catch_up(mode, bus, store, lambda: rec.saw("bad", 4))
        letters = await dl.letters()
        parked = await dl.parked()
    leftover = [(d.event_type, d.reason) for d in letters]
    assert leftover == [], "letters left behind, or the control entry dead-lettered"
    assert parked == {}, "the resource is still parked"
    expected = [1, 2, 3, 4] if kind == "requeue" else [4]
    assert rec.by_resource() == {"bad": expected}


@pytest.mark.parametrize("mode", ["standalone", "live"])
async def test_a_forged_control_entry_met_in_catch_up_is_dead_lettered(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    """A drop entry XADDed by hand (no request recorded by the operator) and
    archived is dead-lettered as forged by the catch-up; the parked letters stay."""
    from eventbus.dlq import DROP, control_entry

    store = open_store(str(tmp_path / "segments"))
    rec = Recorder()
    settings = settings_for(redis_db)
    parker = tick_bus(settings, rec, broken={("bad", 1)}, on_failure="park", max_attempts=1)
    async with parker:
        await create_group(parker)
        await publish(parker, "bad", range(1, 3))

        async def all_dead_lettered() -> bool:
            return len(await letters_of(parker)) == 2

        async with running(parker):
            await wait_until(all_dead_lettered)

    bus = tick_bus(
        settings, rec, archive=store if mode == "live" else None, on_failure="park", max_attempts=1
    )
    async with bus:
        await bus.redis.xadd(bus.keys.stream(TOPIC, 0), control_entry(DROP, "bad", GROUP))
        await archive_backlog(bus, store)

        async def forged_dead_lettered() -> bool:
            return len(await letters_of(bus)) == 3

        await run_catch_up(mode, bus, store, forged_dead_lettered)
        letters = await letters_of(bus)
        parked = await dead_letters(bus).parked()
    assert [d.reason for d in letters] == ["failed", "parked", "forged"]
    assert list(parked) == ["bad"]
    assert rec.calls == []


# -- 6. validators raising anything -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_validator_raising_any_error_is_dead_lettered_in_catch_up(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    """A model validator raising KeyError (not wrapped by pydantic): the entry is dead-lettered
    as undecodable and the rest of the shard handled; the catch-up neither fails nor (live)
    releases the shard unread over and over."""
    store = open_store(str(tmp_path / "segments"))
    bus = EventBus(settings_for(redis_db), archive=store if mode == "live" else None)
    seen: list[str] = []

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Code) -> None:
        seen.append(event.code)

    async with bus:
        await create_group(bus)
        ids = [
            await bus.publish(TOPIC, code, resource_id="c1")
            for code in (
                Code(resource="c1", code="ok1"),
                Code.model_construct(resource="c1", code="boom"),  # skips the validator
                Code(resource="c1", code="ok2"),
            )
        ]
        await archive_backlog(bus, store)
        await run_catch_up(mode, bus, store, lambda: "ok2" in seen)
        letters = await letters_of(bus)
    assert seen == ["ok1", "ok2"]
    assert [(d.entry_id, d.reason) for d in letters] == [(ids[1], "undecodable")]
    assert "KeyError" in letters[0].error
