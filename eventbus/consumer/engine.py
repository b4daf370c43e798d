"""One consumer of one (topic, group), assembled from its two parts: lock -> recover -> read ->
process in order -> ack -> unlock.

* `Ownership` (`ownership`): the lock round, lease, held-shard table, trim checks, catch-up
  scheduling, PEL recovery, release and leave. It is the fence of every entry handled.
* `Pipeline` (`pipeline`): reader -> decode -> queues and workers -> acks, given the Ownership.

The three assemblies: a **group** consumer is an Ownership and a Pipeline with one queue per
resource (`pipeline.per_resource`); a **batch** one the same with one queue per shard run in
batches (`batching.batch_queues`), both wired here at construction; a **broadcast** one
(`broadcast.BroadcastConsumer`) is an open ownership (`open_ownership`: every shard, no lock, no
lease, a fence that always holds, its own read positions) with the same Pipeline and read loop,
reading with ``XREAD`` from the positions (`position_reads`), dropping what a group dead-letters.

The life of a round (`Pipeline.round`, run by `supervision.read_loop`):

1. **Acquire**: ``lock_shards.lua`` refreshes this consumer's liveness and takes shard locks up to
   its fair share, ``floor(shards / live consumers)`` or one more (`eventbus.locking.locks`).
   Steps 1-5 run at most every `lock_interval_ms` (at once when no shard is held or the lease
   ran out); the rounds between them read the shards held.
2. **Apply** the grants to the held-shard table (`shards`): shards lost to others are forgotten,
   shards newly held get a new generation.
3. **Catch up** newly held shards from the durable tier when the group fell behind Redis's first
   entry (only with an archive: `eventbus.tier.catchup`).
4. **Recover** the pending entries of newly held shards first (`reading`).
5. **Surplus**: shards above the fair share stop being read and are released once drained.
6. **Read** new entries of the held shards with ``XREADGROUP`` (only with a valid lease, blocking
   no longer than it lasts) into per-resource queues (`queues`), run by a pool of workers
   through the handling path (`handling`), acked in batches (`acks`).
7. **Release** shards idle for `idle_release_ms`.

Fencing: the consumer trusts its locks only while its lease (`lease`) is valid. Without one it
starts no handler and sends no XACK or XREADGROUP. docs/semantics.md states the guarantee.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import anyio

from eventbus.client import retry
from eventbus.consumer.batching import batch_queues, is_batch
from eventbus.consumer.catching_up import CatchUpHook
from eventbus.consumer.context import Subscription
from eventbus.consumer.failures import Failures
from eventbus.consumer.handling import Handling
from eventbus.consumer.ownership import Ownership
from eventbus.consumer.pipeline import Pipeline, Queues, per_resource
from eventbus.consumer.reading import Reader
from eventbus.consumer.supervision import count_refusals, read_loop, start_when_reachable
from eventbus.locking.lease import heartbeat_loop
from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts
from eventbus.protocol.topics import TopicRegistry

if TYPE_CHECKING:
    from eventbus.consumer.running import ReadMarks

log = logging.getLogger("eventbus.consumer")


class Consumer:
    """Runs one `Subscription` until stopped: its `Ownership` and its `Pipeline`, wired here.
    Created by `EventBus.run`; one per subscription (a `BroadcastConsumer` for a broadcast one).
    """

    def __init__(
        self,
        member: Member,
        registry: TopicRegistry,
        sub: Subscription,
        scripts: Scripts | None = None,
        *,
        catch_up: Callable[[Handling], CatchUpHook] | None = None,
    ) -> None:
        """`member` names this consumer (its topic and group are `sub`'s); `registry` checks the
        topic's shard count; `scripts` are the lock scripts to share (default: registered);
        `catch_up` makes the durable tier's catch-up hook from the handling path (with an
        archive: `eventbus.consumer.catchup.shard_hook`)."""
        settings = self.settings = member.settings
        self.registry, self.sub, self.topic, self.group = registry, sub, sub.topic, sub.group
        self.consumer_id = member.consumer_id
        backoff = retry.backoff(settings.retry_base_s, settings.retry_max_s)
        refusals = count_refusals(self.topic.name, self.group)
        own = Ownership(member, sub, scripts=scripts, backoff=backoff, on_refused=refusals)
        count = settings.read_count
        queues: Queues = per_resource
        if is_batch(sub.call):  # full batches: a read as large as a batch
            count, queues = max(count, sub.call.max_batch), batch_queues
        self.ownership, self.lease = own, own.lease
        failures = partial(
            Failures,
            member,
            sub,
            retry.forever(settings.retry_base_s, settings.retry_max_s),
            fenced_off=own.fenced_off,
            # (a custom lock client written before `ShardLocks.fences_writes`: cannot fence)
            fence_in_redis=getattr(own.locks, "fences_writes", False),
        )
        self.reader = Reader(member, own.table.streams, noack=own.noack, count=count)
        self.pipeline = Pipeline(
            member,
            sub,
            own,
            self.reader,
            count=count,
            queues=queues,
            failures=failures,
            catch_up=catch_up,
            backoff=backoff,
            on_refused=refusals,
        )
        self.handling, self.tally = self.pipeline.handling, self.pipeline.tally
        self.started = anyio.Event()  # set once its groups exist: it reads from their position

    @property
    def in_flight(self) -> int:
        """Entries read (or claimed) and not yet finished: acked, or let go unacked."""
        return self.pipeline.acks.in_flight

    def mark_reads(self, marks: Callable[[str], ReadMarks]) -> None:
        """Its group on every shard stream of the topic: Redis knows what the group was
        delivered and what it has pending (`Running.mark_reads`)."""
        for stream in self.ownership.table.streams:
            marks(stream).groups.append(self.group)

    async def run(self, stop: anyio.Event) -> None:
        """Consume until `stop` is set, then shut down gracefully.

        Graceful shutdown: stop reading, let running handlers finish, flush their acks, release
        every lock and leave the group's live members, so another consumer takes the shards over
        at its next round rather than after the liveness TTL. Events queued but not started stay
        pending and are recovered, in order, by the next owner; an at-most-once consumer's
        (``NOACK``: acknowledged when read) are handled first. Waits at most
        `shutdown_grace_s` seconds for in-flight entries.

        Raises `ShardCountMismatch` at start if the topic's stored shard count differs; a lost
        connection at start is retried until Redis answers or `stop` is set (then it returns,
        holding nothing: `start_when_reachable`).
        """
        own, pipe, settings = self.ownership, self.pipeline, self.settings
        waits = retry.Waits(retry.backoff(settings.retry_base_s, settings.retry_max_s), log)
        if not await start_when_reachable(self._start, stop, waits, f"consumer {self.consumer_id}"):
            self.started.set()
            await pipe.reader.aclose()
            return
        self.started.set()
        log.info(
            "consumer %s starts on topic %s group %s (%d shards)",
            self.consumer_id,
            self.topic.name,
            self.group,
            self.topic.shards,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    heartbeat_loop,
                    own.locks,
                    settings.liveness_ttl_s,
                    own.joined,
                    own.lease.renew,
                    own.expired,
                )
                tg.start_soon(pipe.acks.loop)
                tg.start_soon(pipe.handling.watchdog.run)
                pipe.queues.start_workers(
                    lambda: tg.start_soon(pipe.worker, tg), settings.concurrency
                )
                tg.start_soon(pipe.stop_starting, stop)
                await read_loop(pipe, own, self.registry, stop)
                await pipe.acks.drain(settings.shutdown_grace_s, pipe.handling.watchdog.running)
                tg.cancel_scope.cancel()
        finally:
            pipe.report_handled()
            with anyio.CancelScope(shield=True):
                await own.leave()
                await pipe.reader.aclose()

    async def _start(self) -> None:
        await self.registry.ensure(self.topic)
        await self.reader.ensure_groups()
