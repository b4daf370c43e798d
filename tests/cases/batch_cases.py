"""Batch handlers (`eventbus.consumer.batching`), as test cases run on fakeredis and on a real
redis-server (`cases.backends`): stream order inside and across batches, acks, a batch retried
in place, a split that isolates a failing entry (continue), parking from inside a batch, and
undecodable entries breaking a batch in their place.

Every case publishes before the consumer starts, so its first read queues each shard's entries
at once and the first batch of a shard holds all of them (at most `max_batch`): batch sizes are
deterministic, whatever the machine's load.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import anyio
import pytest
from cases.backends import Backend
from support import Tick, running, total_pending, wait_until

from eventbus import ConfigError, Context, EventBus, shard_of
from eventbus.dlq import DeadLetters
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE

TOPIC, GROUP = "orders", "billing"


class BatchLog:
    """What a batch handler saw: every call's (resource, seq) list, and successes in order."""

    def __init__(self, broken: set[tuple[str, int]] | None = None, fail_first: int = 0) -> None:
        self.calls: list[list[tuple[str, int]]] = []
        self.ctxs: list[list[Context]] = []
        self.done: list[tuple[str, int]] = []
        self.broken = broken if broken is not None else set()
        self.fail_first = fail_first  # fail this many calls first, whatever they hold

    def handle(self, events: list[Tick], ctxs: list[Context]) -> None:
        keys = [(e.resource, e.seq) for e in events]
        self.calls.append(keys)
        self.ctxs.append(ctxs)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise RuntimeError("transient")
        bad = [k for k in keys if k in self.broken]
        if bad:
            raise RuntimeError(f"cannot handle {bad}")
        self.done.extend(keys)

    def by_resource(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for rid, seq in self.done:
            out[rid].append(seq)
        return dict(out)


def batch_bus(backend: Backend, log: BatchLog, **sub: Any) -> EventBus:
    bus = backend.bus(shards=2, retry_base_s=0.001, retry_max_s=0.002, max_attempts=2)

    @bus.subscriber(TOPIC, group=GROUP, batch=True, **sub)
    async def handle(events: list[Tick], ctxs: list[Context]) -> None:
        log.handle(events, ctxs)

    return bus


async def publish(bus: EventBus, resource: str, seqs: range) -> None:
    for seq in seqs:
        await bus.publish(TOPIC, Tick(resource=resource, seq=seq), resource_id=resource)


async def drained(bus: EventBus, r: Any) -> bool:
    return await total_pending(bus, TOPIC, GROUP, r) == 0


async def letters_are(dl: DeadLetters, n: int) -> bool:
    return len(await dl.letters()) == n


def same_shard(n: int, shards: int = 2) -> list[str]:
    """`n` resource IDs that hash to one shard."""
    out = [f"r{i}" for i in range(200) if shard_of(f"r{i}", shards) == 0]
    return out[:n]


class BatchCases:
    """Batch handlers on the `backend` a subclass provides (`cases.backends`)."""

    pytestmark = pytest.mark.anyio

    async def test_batches_hold_one_shard_in_stream_order_and_are_acked(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        log = BatchLog()
        bus = batch_bus(backend, log, max_batch=7)
        ids: dict[tuple[str, int], str] = {}
        for i in range(40):
            rid = f"r{i % 5}"
            ids[(rid, i)] = await bus.publish(TOPIC, Tick(resource=rid, seq=i), resource_id=rid)
        async with running(bus) as [run]:
            await wait_until(lambda: len(log.done) == 40)
            await wait_until(lambda: drained(bus, r))
        assert sorted(log.done) == sorted(ids)
        assert max(len(c) for c in log.calls) == 7  # full batches, never more than max_batch
        for keys, ctxs in zip(log.calls, log.ctxs, strict=True):
            shards = {c.shard for c in ctxs}
            assert len(shards) == 1  # one shard per batch
            entry_ids = [tuple(map(int, c.entry_id.split("-"))) for c in ctxs]
            assert entry_ids == sorted(entry_ids)  # stream order inside the batch
            assert [c.entry_id for c in ctxs] == [ids[k] for k in keys]
            assert all(c.attempt == 1 and c.consumer_id == run.consumer_ids[0] for c in ctxs)
        for seqs in log.by_resource().values():
            assert seqs == sorted(seqs)  # per-resource order across batches
        assert bus.consumers[0].tally.handled == 40

    async def test_a_batch_can_fill_past_read_count(self, backend: Backend) -> None:
        """A read asks for ``max(read_count, max_batch)`` entries per shard, so that a batch
        subscriber's batches fill (the read's COUNT is fixed when the consumer is built)."""
        log = BatchLog()
        bus = backend.bus(shards=2, read_count=10)

        @bus.subscriber(TOPIC, group="g", batch=True, max_batch=50)
        async def handle(events: list[Tick]) -> None:
            log.calls.append([(e.resource, e.seq) for e in events])

        rid = same_shard(1)[0]
        for i in range(40):  # all there before the consumer's first read
            await bus.publish(TOPIC, Tick(resource=rid, seq=i), resource_id=rid)
        async with running(bus):
            await wait_until(lambda: sum(map(len, log.calls)) == 40)
        assert [len(c) for c in log.calls] == [40]

    async def test_the_next_read_is_on_its_way_while_a_full_read_runs(
        self, backend: Backend
    ) -> None:
        """With the default `max_in_flight`, a consumer whose read filled every shard's batch
        (4 shards x 500 = 2,000 entries) reads again while those batches are still in the
        handler: Redis builds the next reply while the workers decode and handle, rather than
        after their XACKs are confirmed (with the old default, 2,000, the read loop waited
        for capacity until the handlers returned)."""
        r = backend.redis
        bus = backend.bus(shards=4)
        release = anyio.Event()
        sizes: list[int] = []

        @bus.subscriber(TOPIC, group=GROUP, batch=True, max_batch=500)
        async def handle(events: list[Tick]) -> None:
            sizes.append(len(events))
            await release.wait()

        pairs = [(f"r{i % 64}", Tick(resource=f"r{i % 64}", seq=i)) for i in range(8000)]
        for i in range(0, len(pairs), 1000):
            await bus.publish_many(TOPIC, pairs[i : i + 1000])
        per_shard = [await r.xlen(bus.keys.stream(TOPIC, s)) for s in range(4)]
        assert min(per_shard) >= 1000  # two full reads of every shard at least
        async with running(bus):
            await wait_until(lambda: len(sizes) == 4)  # one batch of each shard, held

            # every shard's second 500 delivered while the first four batches are held
            async def read_ahead() -> bool:
                return await total_pending(bus, TOPIC, GROUP, r) >= 4000

            await wait_until(read_ahead)
            release.set()
            await wait_until(lambda: sum(sizes) == 8000)
            await wait_until(lambda: drained(bus, r))
        assert sizes[:4] == [500] * 4

    async def test_a_failing_batch_is_retried_whole_then_acked(self, backend: Backend) -> None:
        r = backend.redis
        log = BatchLog(fail_first=1)
        rids = same_shard(2)
        bus = batch_bus(backend, log)
        for rid in rids:
            await publish(bus, rid, range(3))
        async with running(bus):
            await wait_until(lambda: len(log.done) == 6)
            await wait_until(lambda: drained(bus, r))
        assert log.calls[0] == log.calls[1] and len(log.calls[0]) == 6
        assert [c.attempt for c in log.ctxs[1]] == [2] * 6
        assert len(await DeadLetters(r, bus.keys, bus.topic(TOPIC), GROUP).letters()) == 0

    async def test_split_isolates_the_failing_entry_and_the_rest_is_handled(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        a, b = same_shard(2)
        log = BatchLog(broken={(a, 2)})
        bus = batch_bus(backend, log)
        dl = DeadLetters(r, bus.keys, bus.topic(TOPIC), GROUP)
        await publish(bus, a, range(4))
        await publish(bus, b, range(4))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 1))
            await wait_until(lambda: len(log.done) == 7)
            await wait_until(lambda: drained(bus, r))
        assert log.by_resource() == {a: [0, 1, 3], b: [0, 1, 2, 3]}
        assert log.calls[0] == log.calls[1]  # the whole batch, max_attempts times
        assert [(a, 2)] in log.calls  # split down to the failing entry
        letters = await dl.letters()
        assert [(d.resource_id, d.reason) for d in letters] == [(a, "failed")]
        # stream order holds through the split: a#3 ran after a#2 was dead-lettered
        assert log.done.index((a, 3)) > log.done.index((a, 1))

    async def test_park_from_a_batch_dead_letters_the_resource_later_entries(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        a, b = same_shard(2)
        log = BatchLog(broken={(a, 1)})
        bus = batch_bus(backend, log, on_failure="park")
        dl = DeadLetters(r, bus.keys, bus.topic(TOPIC), GROUP)
        await publish(bus, a, range(4))
        await publish(bus, b, range(3))
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 3))  # a#1 failed, a#2 and a#3 parked
            await wait_until(lambda: len(log.done) == 4)
            await wait_until(lambda: drained(bus, r))
        assert log.by_resource() == {a: [0], b: [0, 1, 2]}
        assert [(d.resource_id, d.reason) for d in await dl.letters()] == [
            (a, "failed"),
            (a, "parked"),
            (a, "parked"),
        ]
        assert list(await dl.parked()) == [a]

    async def test_undecodable_entry_breaks_the_batch_in_its_place(self, backend: Backend) -> None:
        r = backend.redis
        (a,) = same_shard(1)
        log = BatchLog()
        bus = batch_bus(backend, log)
        dl = DeadLetters(r, bus.keys, bus.topic(TOPIC), GROUP)
        await publish(bus, a, range(2))
        stream = bus.keys.stream(TOPIC, shard_of(a, 2))
        await r.xadd(stream, {F_RESOURCE: a.encode(), F_TYPE: b"Tick", F_DATA: b"\x01\xc1"})
        await publish(bus, a, range(2, 4))
        async with running(bus):
            await wait_until(lambda: len(log.done) == 4)
            await wait_until(lambda: drained(bus, r))
        assert log.calls == [[(a, 0), (a, 1)], [(a, 2), (a, 3)]]
        assert [d.reason for d in await dl.letters()] == ["undecodable"]

    async def test_a_sync_handler_of_events_alone(self, backend: Backend) -> None:
        r = backend.redis
        bus = backend.bus(shards=2)
        seen: list[list[int]] = []

        @bus.subscriber(TOPIC, group=GROUP, batch=True)
        def handle(events: list[Tick]) -> None:  # runs in a worker thread
            seen.append([e.seq for e in events])

        await publish(bus, "a", range(5))
        async with running(bus):
            await wait_until(lambda: sum(map(len, seen)) == 5)
            await wait_until(lambda: drained(bus, r))
        assert seen == [[0, 1, 2, 3, 4]]

    async def test_batch_handler_signature_and_options_are_checked(self, backend: Backend) -> None:
        bus = backend.bus()
        with pytest.raises(ConfigError, match=r"list\[Model\]"):

            @bus.subscriber(TOPIC, group="g1", batch=True)
            async def single(event: Tick) -> None: ...

        with pytest.raises(ConfigError, match="max_batch"):

            @bus.subscriber(TOPIC, group="g2", batch=True, max_batch=0)
            async def zero(events: list[Tick]) -> None: ...

        @bus.subscriber(TOPIC, group="g3", batch=True)
        def sync_ok(events: list[Tick]) -> None: ...

        await bus.aclose()
