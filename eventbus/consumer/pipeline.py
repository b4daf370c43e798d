"""The data path of a group consumer: reader -> decode -> queues and workers -> acks.

A `Pipeline` is given the consumer's `Ownership` (`eventbus.consumer.ownership`): it reads only
the shards held there, with a valid lease, blocking no longer than it lasts; hands each read to
its queues (decoded and validated in one pass first, unless a batch worker decodes them); runs
them through the handling path (`handling`) under the ownership's fence (`runner`, or a batch
subscription's `BatchRunner`); and acks them in batches (`acks`). The queues and the workers'
step are the assembly's choice, made at construction (`Queues`). Everything after the read is
`Stages` (handling, queues and workers, acks). The reads are the assembly's choice too
(`Reads`): a group's `reading.Reader` (``XREADGROUP``, recovery, fenced delivery) or a
broadcast's `position_reads.PositionReader` (``XREAD`` from an open ownership's positions;
`eventbus.consumer.broadcast`, whose last step is `Drops`).

One entry, from the read to the ack: `Reader.read` (``XREADGROUP``, `reading`) ->
`Pipeline._dispatch` -> `Stages.dispatch` -> `Handling.prepare` (`decoding`: envelope, model) ->
`ResourceQueues.dispatch` (`queues`) -> a worker's `QueueRunner.run` (`runner`) ->
`Handling.attempt` (the fence, the handler call) -> `Acks.ack` -> `Acks.loop` (``XACK``,
`acks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.abc
from redis.backoff import AbstractBackoff

from eventbus.client import retry
from eventbus.consumer.acks import Acks
from eventbus.consumer.catching_up import CatchUpHook
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import FailurePolicy, Fence, Tally
from eventbus.consumer.handling import Handling
from eventbus.consumer.ownership import Claimer
from eventbus.consumer.queues import ResourceQueues
from eventbus.consumer.reading import Counts, Dispatch, Entries, Read
from eventbus.consumer.runner import QueueRunner
from eventbus.consumer.shards import HeldShard, ShardTable, read_items
from eventbus.consumer.supervision import refused
from eventbus.locking.lease import Lease
from eventbus.locking.member import Member
from eventbus.ops.metrics import METRICS

Queues = Callable[[Handling, Fence, QueueRunner, Acks], tuple[ResourceQueues, Any]]
"""An assembly's queues and its workers' step, from the pipeline's parts: per resource
(`per_resource`) or per shard in batches (`eventbus.consumer.batching.batch_queues`)."""


def per_resource(
    handling: Handling, fence: Fence, runner: QueueRunner, acks: Acks
) -> tuple[ResourceQueues, Any]:
    """One queue per resource, run entry by entry (`QueueRunner.run`)."""
    return ResourceQueues(acks.started), runner.run


class Reads(Protocol):
    """How a pipeline reads: ``XREADGROUP`` (`reading.Reader`) or ``XREAD`` from positions
    (`position_reads.PositionReader`)."""

    command: str
    """What a refused read names (`supervision.refused`)."""

    async def read(self, shards: list[HeldShard], block_ms: int) -> list[Read]:
        """New entries of `shards`, blocking at most `block_ms` ms when there are none."""
        ...

    async def recover(
        self, shards: list[HeldShard], dispatch: Dispatch, held: Callable[[HeldShard], bool]
    ) -> None:
        """Dispatch the pending entries of newly held `shards` while `held`."""

    async def regroup(self) -> list[str]:
        """After NOGROUP: create the group again; the streams that had vanished."""
        ...

    async def aclose(self) -> None: ...


class Owner(Protocol):
    """What the pipeline and its read loop (`supervision.read_loop`) ask of an ownership: a
    group's (`ownership.Ownership`) or a broadcast's open one (`open_ownership.OpenOwnership`).
    It is the `Fence` too."""

    consumer_id: str
    group: str
    noack: bool
    table: ShardTable

    @property
    def lease(self) -> Lease | None: ...

    @property
    def topic(self) -> Any: ...

    def holds(self, d: Any) -> bool: ...

    async def wait(self, d: Any) -> bool: ...

    def lock_due(self) -> bool: ...

    async def lock_round(self, claimer: Claimer) -> None: ...

    async def check_trims(self, claimer: Any) -> None: ...

    def shard_room(self, count: int) -> int | None: ...

    def poll_ms(self, block_ms: int) -> int: ...

    async def release(self, shards: list[int]) -> None: ...

    def drop_all(self, reason: str, *, lease: bool = True) -> None: ...

    def on_refused(self, command: str) -> None: ...

    def wake(self) -> None: ...

    def let_go(self) -> None: ...


class Stages:
    """The stages of a pipeline after its reads: decode (the handling path) -> queues and
    workers -> acks, under `fence`; every assembly's (a group's `Pipeline`, a broadcast's).

    :param table: the shards read (`Acks` finishes their entries and wakes readers on room)
    :param lease: the lease acks are sent under (None: no lease, nothing fenced)
    :param noack: entries are finished when handled, without ``XACK`` (``NOACK`` reads, a
        broadcast's)
    :param queues: the queues and the workers' step (`per_resource`, or a batch's)
    :param failures: makes the policy for entries that cannot be handled (`Handling`)
    :param backoff: spaces the retries of a failed XACK
    :param on_refused: counts a refused command
    :param shard_room: a shard is read again once at most this many of its entries are in
        flight (None: `max_in_flight`)
    """

    def __init__(
        self,
        member: Member,
        sub: Subscription,
        fence: Fence,
        table: ShardTable,
        lease: Lease | None,
        *,
        noack: bool,
        queues: Queues,
        failures: Callable[[Tally], FailurePolicy],
        backoff: AbstractBackoff,
        on_refused: Callable[[str], None] = lambda command: None,
        shard_room: int | None = None,
    ) -> None:
        settings = self.settings = member.settings
        redis_retry = retry.forever(settings.retry_base_s, settings.retry_max_s)
        self.handling = Handling(member, sub, redis_retry, failures)
        self.acks = Acks(
            member,
            table,
            lease,
            noack=noack,
            backoff=backoff,
            before_send=self.handling.flush_metrics,  # an entry's metrics before its ack
            on_refused=on_refused,
            shard_room=shard_room,
        )
        self.runner = QueueRunner(self.handling, fence, self.acks)
        self.queues, self._work = queues(self.handling, fence, self.runner, self.acks)
        self._prepare = self.queues.prepared_on_read
        self.tally = self.handling.tally  # handled, dead-lettered, duplicates skipped

    def dispatch(self, held: HeldShard, entries: Entries, counts: Counts | None) -> None:
        """Queue what one read (or one page of recovery) got from `held`'s stream, decoded and
        validated in one pass first (`Handling.prepare`), unless the queues' workers decode
        (a batch subscription's: its queues are keyed by shard, not by the resource the decode
        finds, and the read loop sends its next read while the workers decode)."""
        items = read_items(held, entries, counts)
        if self._prepare:
            self.handling.prepare(items)
        self.queues.dispatch(held, items)

    async def worker(self, tg: anyio.abc.TaskGroup) -> None:
        """One of the `concurrency` workers, with its own watchdog slot."""
        stopped = self.handling.stopping  # retry waits end at once
        await self.queues.worker(self._work, self.handling.watchdog.slot(), tg, stopped)


class Pipeline(Stages):
    """Reads, handles and acks the entries of `sub` for `member` on the shards `own` holds:
    `reader` (``XREADGROUP`` and recovery, or ``XREAD`` from positions) -> the `Stages`, fenced
    by `own`.

    :param count: entries a read takes per shard at most (``COUNT``)
    :param queues: the queues and the workers' step (`per_resource`, or a batch's)
    :param failures: makes the policy for entries that cannot be handled (a group's
        `failures.Failures`, a broadcast's `Drops`)
    :param catch_up: makes the durable tier's catch-up hook from the handling path (None: the
        bus has no archive)
    :param backoff: spaces the retries of a failed XACK
    :param on_refused: counts a refused command
    """

    def __init__(
        self,
        member: Member,
        sub: Subscription,
        own: Owner,
        reader: Reads,
        *,
        count: int,
        queues: Queues,
        failures: Callable[[Tally], FailurePolicy],
        catch_up: Callable[[Handling], CatchUpHook] | None,
        backoff: AbstractBackoff,
        on_refused: Callable[[str], None],
    ) -> None:
        self.own, self.table, self.lease = own, own.table, own.lease
        self.noack = own.noack
        self.reader = reader
        self.shard_room = own.shard_room(count)
        super().__init__(
            member,
            sub,
            own,
            self.table,
            self.lease,
            noack=self.noack,
            queues=queues,
            failures=failures,
            backoff=backoff,
            on_refused=on_refused,
            shard_room=self.shard_room,
        )
        self.catch_up = None if catch_up is None else catch_up(self.handling)
        self.read_full = False  # the last read filled a shard's read_count (`read_linger_ms`)
        self.held_back = False  # waited for room since the last read (`supervision.read_loop`)
        self.stopping = False  # set at the stop: no more reads
        self._handled_reported = 0
        self._m_handled = METRICS.handled.labels(sub.topic.name, sub.group)

    # -- what a round asks of the pipeline (`ownership.Claimer`) -------------------------------
    async def load_parked(self) -> None:
        await self.handling.failures.load_parked()

    async def claim(self, held: list[HeldShard], still_held: Callable[[HeldShard], bool]) -> None:
        await self.reader.recover(held, self._dispatch, still_held)

    # -- the round ------------------------------------------------------------------------------
    async def round(self, block_ms: int) -> bool:
        """One round: a lock round when due (`Ownership.lock_due`: acquire, apply, catch up,
        recover, surplus), the trim check, a read, the release of idle shards. Returns whether
        any entry was read."""
        own = self.own
        self.report_handled()  # before the trim check's lag gauges and the blocking read
        if own.lock_due():
            await own.lock_round(self)
        await own.check_trims(self)
        if self.stopping:  # stopped meanwhile: no read after the stop (the workers let the
            return False  # queued entries go, so every shard looks readable)
        got = await self._read(block_ms)
        if got is None:  # no lease: re-lock in the next round
            return False
        idle = self.table.to_release(got, time.monotonic(), self.settings.idle_release_ms / 1000)
        if idle:
            await own.release(idle)
        self.report_handled()
        return bool(got)

    async def _read(self, block_ms: int) -> set[int] | None:
        """Read the readable shards into the queues; the shards that had entries, or None when
        the read was skipped for want of a lease.

        XREADGROUP is not fenced by Redis: a read sent after the lease ran out (a process paused
        past its TTL) would pull entries of shards now owned by others into our PEL, and their
        owner would read past them. So read only with a lease, blocking no longer than it lasts;
        without one, skip the read and re-lock in the next round."""
        table = self.table
        readable = table.readable(self.shard_room)
        active = len(table.readable())  # held and not draining
        if not readable:  # nothing to read (all draining or full, or none held): wait a poll
            behind = any(h.behind for h in table.held.values())
            with anyio.move_on_after(self.own.poll_ms(block_ms) / 1000):
                if active or behind:  # until a full shard has room, or one behind drained
                    await table.changed()
                else:
                    await anyio.sleep_forever()
            return set()
        if len(readable) < active:  # a full shard gets room while the read blocks: not long
            block_ms = min(block_ms, self.settings.block_min_ms)
        block_ms = self.own.poll_ms(block_ms)  # owed shards: the next lock round comes soon
        if self.lease is not None:  # (an open ownership has none: its reads are not fenced)
            lease_ms = self.lease.remaining_ms() - 5
            if lease_ms < 1:
                return None
            block_ms = min(block_ms, lease_ms)
        got = set()
        with refused(self.reader.command, ",".join(h.stream for h in readable)):
            reads = await self.reader.read(readable, block_ms)
        count = self.settings.read_count
        self.read_full = any(len(read.entries) >= count for read in reads)
        self.held_back = False
        for read in reads:
            held = table.of_stream(read.stream)
            if held is not None:
                got.add(held.shard)
                self._dispatch(held, read.entries, read.counts)
        return got

    def _dispatch(self, held: HeldShard, entries: Entries, counts: Counts) -> None:
        self.dispatch(held, entries, counts)  # (the reads' and recovery's: `Stages.dispatch`)

    # -- the stop -------------------------------------------------------------------------------
    async def stop_starting(self, stop: anyio.Event) -> None:
        """Once `stop` is set, read no more and, at once, start no more handlers: the read loop
        may still be in a blocking read for a while, and queued entries must not keep running
        meanwhile, or a large backlog would delay the hand-over (they stay pending for the next
        owner). An at-most-once consumer's entries were acknowledged when read (``NOACK``): it
        handles what it read, the read in flight at the stop included, within
        `shutdown_grace_s`, instead of dropping it."""
        await stop.wait()
        self.stopping = True
        self.handling.halting.set()
        if not self.noack:
            self.own.let_go()
            self.handling.stopping.set()
        self.own.wake()

    def report_handled(self) -> None:
        """Add the handler successes since the last call to the Prometheus counter, and the
        latencies and durations to their histograms (once a round rather than once an event: a
        labelled increment costs a few microseconds)."""
        self.handling.flush_metrics()
        handled = self.tally.handled
        self._m_handled.inc(handled - self._handled_reported)
        self._handled_reported = handled
