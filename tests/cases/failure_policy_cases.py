"""Failure policies, as test cases run on fakeredis and on a real redis-server (`cases.backends`):
continue, park (then requeue or drop the resource), requeue/drop of single letters, de-duplication
by event ID, retries that do not hold a worker while they wait, and validators that raise anything.

The CLI case (it needs a Redis URL) is in `tests/integration/test_failure_policy.py`.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from cases.backends import Backend
from pydantic import BaseModel, field_validator
from support import Recorder, Tick, running, total_pending, wait_until

from eventbus import Context, EventBus
from eventbus.dlq import DeadLetters
from eventbus.protocol.codec import Envelope, new_event_id


class Strict(BaseModel):
    code: str

    @field_validator("code", mode="before")
    @classmethod
    def upper(cls, v: str) -> str:
        return v.upper()  # AttributeError for an int: not a pydantic ValidationError


def failing_bus(backend: Backend, broken: set[tuple[str, int]], **sub: object):
    """A bus whose handler raises for (resource, seq) pairs in `broken` (mutable)."""
    bus = backend.bus(shards=2, retry_base_s=0.001, retry_max_s=0.002, max_attempts=2)
    rec = Recorder()

    @bus.subscriber("orders", group="billing", **sub)  # type: ignore[arg-type]
    async def handle(event: Tick, ctx: Context) -> None:
        if (event.resource, event.seq) in broken:
            raise RuntimeError(f"cannot handle {event.resource}#{event.seq}")
        rec.add(event, ctx)

    return bus, rec


async def publish(bus: EventBus, resource: str, seqs: range) -> None:
    for seq in seqs:
        await bus.publish("orders", Tick(resource=resource, seq=seq), resource_id=resource)


def dead_letters(bus: EventBus, r: Any) -> DeadLetters:
    return DeadLetters(r, bus.keys, bus.topic("orders"), "billing")


async def letters_are(dl: DeadLetters, n: int) -> bool:
    return len(await dl.letters()) == n


async def drained(bus: EventBus, r: Any) -> bool:
    return await total_pending(bus, "orders", "billing", r) == 0


def envelope(rid: str, event_type: str, payload: object) -> Envelope:
    return Envelope(rid, event_type, new_event_id(), time.time_ns() // 1_000_000, {}, payload)


class FailurePolicyCases:
    """Failure policies on the `backend` a subclass provides (`cases.backends`)."""

    pytestmark = pytest.mark.anyio

    async def test_continue_dead_letters_the_event_and_goes_on(self, backend: Backend) -> None:
        r = backend.redis
        bus, rec = failing_bus(backend, {("bad", 2)})
        await publish(bus, "bad", range(1, 5))
        async with running(bus):
            await rec.wait_for(3)
            await wait_until(lambda: drained(bus, r))
        letters = await dead_letters(bus, r).letters()
        assert rec.by_resource() == {"bad": [1, 3, 4]}
        assert [(d.resource_id, d.reason, d.attempts) for d in letters] == [("bad", "failed", 2)]
        assert "cannot handle bad#2" in letters[0].error

    async def test_park_holds_the_resource_back_then_requeue_replays_in_order(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        broken = {("bad", 2)}
        bus, rec = failing_bus(backend, broken, on_failure="park")
        dl = dead_letters(bus, r)
        await publish(bus, "bad", range(1, 5))
        await publish(bus, "good", range(1, 4))
        async with running(bus):
            await rec.wait_for(4)  # bad#1 and good#1..3
            await wait_until(lambda: letters_are(dl, 3))  # bad#2 failed, bad#3 and #4 parked
            assert rec.by_resource() == {"bad": [1], "good": [1, 2, 3]}
            assert list(await dl.parked()) == ["bad"]
            assert [(d.reason, d.attempts) for d in await dl.letters()] == [
                ("failed", 2),
                ("parked", 0),
                ("parked", 0),
            ]
            broken.clear()  # the operator fixed the cause
            await dl.requeue_resource("bad")
            await publish(bus, "bad", range(5, 6))  # published after the requeue request
            await rec.wait_for(8)
            await wait_until(lambda: letters_are(dl, 0))
        assert rec.by_resource() == {"bad": [1, 2, 3, 4, 5], "good": [1, 2, 3]}
        assert await dl.parked() == {}

    async def test_a_parked_field_that_is_not_utf8_is_skipped_not_a_stop(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The parked hash is Redis data another client may write: a field that is not UTF-8
        (no resource ID is) stopped the consumer at every shard lock (`UnicodeDecodeError` out
        of loading the parked set). It names no resource, so it is skipped, with a warning; the
        parked resources beside it stay parked."""
        r = backend.redis
        bus, rec = failing_bus(backend, set(), on_failure="park")
        key = bus.keys.parked("orders", "billing")
        await r.hset(key, mapping={b"\xff\xfe": b"1-0", b"held": b"2-0"})
        await publish(bus, "good", range(1, 4))
        await publish(bus, "held", range(1, 3))
        async with running(bus):
            await rec.wait_for(3)
            await wait_until(lambda: letters_are(dead_letters(bus, r), 2))  # held#1, #2 parked
        assert rec.by_resource() == {"good": [1, 2, 3]}
        assert "not UTF-8" in caplog.text

    async def test_drop_resource_discards_its_parked_events_and_unparks_it(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus, rec = failing_bus(backend, {("bad", 1)}, on_failure="park")
        dl = dead_letters(bus, r)
        await publish(bus, "bad", range(1, 4))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 3))
            await dl.drop_resource("bad")
            await publish(bus, "bad", range(4, 6))
            await rec.wait_for(2)
            await wait_until(lambda: letters_are(dl, 0))
        assert rec.by_resource() == {"bad": [4, 5]}
        assert await dl.parked() == {}

    async def test_a_replay_retry_waiting_at_shutdown_lets_go_at_once(
        self, backend: Backend
    ) -> None:
        """The replay of a requeued resource waited for its next attempt with a
        sleep that did not wake on shutdown, so stopping took the whole retry delay (or the
        grace); now the wait ends on stop and the resource stays parked, letters in place."""
        r = backend.redis
        bus, _ = failing_bus(backend, {("bad", 1)}, on_failure="park")
        dl = dead_letters(bus, r)
        await publish(bus, "bad", range(1, 3))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 2))  # bad#1 failed, bad#2 parked
        replaying = backend.bus(
            shards=2, retry_base_s=3600, retry_max_s=3600, max_attempts=2, shutdown_grace_s=30
        )
        tries: list[int] = []
        failed = anyio.Event()

        @replaying.subscriber("orders", group="billing", on_failure="park")
        async def handle(event: Tick) -> None:
            tries.append(event.seq)
            failed.set()
            raise RuntimeError("still broken")

        with anyio.fail_after(20):  # the old wait: an hour, cut by the 30 s grace
            async with running(replaying):
                await dl.requeue_resource("bad")
                await failed.wait()
        assert tries == [1]
        assert list(await dl.parked()) == ["bad"]
        assert [d.reason for d in await dl.letters()] == ["failed", "parked"]

    async def test_requeue_and_drop_single_letters(self, backend: Backend) -> None:
        r = backend.redis
        broken = {("a", 1), ("b", 1)}
        bus, rec = failing_bus(backend, broken)
        dl = dead_letters(bus, r)
        await publish(bus, "a", range(1, 2))
        await publish(bus, "b", range(1, 2))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 2))
            by_resource = {d.resource_id: d.dlq_id for d in await dl.letters()}
            broken.clear()
            new_ids = await dl.requeue([by_resource["a"]])
            assert await dl.drop([by_resource["b"]]) == 1
            await rec.wait_for(1)
            await wait_until(lambda: letters_are(dl, 0))
        assert rec.by_resource() == {"a": [1]}
        assert rec.log[0].ctx.entry_id == new_ids[0]

    async def test_parked_resource_letters_cannot_be_requeued_one_by_one(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus, _ = failing_bus(backend, {("bad", 1)}, on_failure="park")
        dl = dead_letters(bus, r)
        await publish(bus, "bad", range(1, 3))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 2))
        ids = [d.dlq_id for d in await dl.letters()]
        with pytest.raises(Exception, match="is parked; requeue the resource"):
            await dl.requeue(ids[1:])
        with pytest.raises(Exception, match="is not parked"):
            await dl.requeue_resource("never-failed")
        assert len(await dl.letters()) == 2  # nothing moved

    async def test_dedup_window_skips_a_redelivered_event_id(self, backend: Backend) -> None:
        r = backend.redis
        bus, rec = failing_bus(backend, set(), dedup_window_s=60)
        await publish(bus, "x", range(1, 2))
        stored = [
            (stream, fields)
            for stream in (bus.keys.stream("orders", i) for i in range(2))
            for _, fields in await r.xrange(stream)
        ]
        stream, fields = stored[0]
        await r.xadd(stream, fields)  # the same event (same event ID) again: an ambiguous retry
        await publish(bus, "x", range(2, 3))
        async with running(bus) as runs:
            await rec.wait_for(2)
            await wait_until(lambda: drained(bus, r))
            await wait_until(lambda: runs[0].bus.consumers[0].tally.duplicates_skipped == 1)
        assert rec.by_resource() == {"x": [1, 2]}

    async def test_a_retrying_resource_does_not_hold_the_only_worker(
        self, backend: Backend
    ) -> None:
        bus = backend.bus(shards=1, concurrency=1, max_attempts=3, retry_base_s=0.3)
        order: list[str] = []
        failures = {"slow": 2}

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick) -> None:
            if failures.get(event.resource, 0) > 0:
                failures[event.resource] -= 1
                order.append(f"{event.resource} failed")
                raise RuntimeError("transient")
            order.append(f"{event.resource} ok")

        await publish(bus, "slow", range(1, 2))
        await publish(bus, "fast", range(1, 2))
        async with running(bus):
            await wait_until(lambda: order.count("slow ok") == 1 and "fast ok" in order)
        # with one worker, "fast" ran while "slow" waited out its backoff
        assert order.index("fast ok") < order.index("slow ok")
        assert order[0] == "slow failed"

    async def test_a_validator_raising_any_error_is_dead_lettered_not_a_crash(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus = backend.bus(shards=1)
        seen: list[str] = []

        @bus.subscriber("codes", group="g")
        async def handle(event: Strict) -> None:
            seen.append(event.code)

        stream = bus.keys.stream("codes", 0)
        async with bus:
            await bus.publisher.publish_envelope(
                bus.topic("codes"), envelope("c1", "Strict", {"code": 7})
            )
            await bus.publish("codes", Strict(code="ok"), resource_id="c1")
        dl = DeadLetters(r, bus.keys, bus.topic("codes"), "g")
        async with running(bus):
            await wait_until(lambda: seen == ["OK"])
            await wait_until(lambda: letters_are(dl, 1))
        (letter,) = await dl.letters()
        assert letter.reason == "undecodable" and "AttributeError" in letter.error
        assert await r.xpending(stream, "g") == {
            "pending": 0,
            "min": None,
            "max": None,
            "consumers": [],
        }

    async def test_park_holds_with_ack_before_across_consumers(self, backend: Backend) -> None:
        r = backend.redis
        seen: list[int] = []

        def make() -> EventBus:
            bus = backend.bus(shards=1, max_attempts=1)

            @bus.subscriber("orders", group="g", ack="before", on_failure="park")
            async def handle(event: Tick) -> None:
                seen.append(event.seq)
                if event.seq == 1:
                    raise RuntimeError("boom")

            return bus

        first = make()
        dl = DeadLetters(r, first.keys, first.topic("orders"), "g")
        await publish(first, "R", range(1, 2))
        async with running(first):
            await wait_until(lambda: letters_are(dl, 1))
        assert list(await dl.parked()) == ["R"]
        second = make()  # a restarted process: it must learn that R is parked
        await publish(second, "R", range(2, 3))
        async with running(second):
            await wait_until(lambda: letters_are(dl, 2))
        assert seen == [1]
        assert [d.reason for d in await dl.letters()] == ["failed", "parked"]
