"""Broadcast subscribers: ``@bus.subscriber(topic, broadcast=True)``.

Every running instance gets every event of the topic published while it runs (cache
invalidation, configuration reloads, local read models). A `BroadcastConsumer` reads the
topic's shard streams with plain ``XREAD`` from where they ended when it started: no consumer
group, no lock, no lease, no ack, so nothing to clean up in Redis on shutdown and nothing left
behind by a crashed instance. Its guarantees are those of a plain read:

* **At most once per instance**: an event published while the instance was not reading (before
  it started, during a crash or a restart) is not delivered to it, and a handler that keeps
  failing after its retries (the subscriber's `RetryPolicy`, in place) is logged at ERROR and
  dropped: there is no dead-letter stream (an undecodable entry or an unknown type is logged
  and dropped too, or skipped with ``on_unknown="skip"``). On shutdown, what was read is still
  handled for up to `shutdown_grace_s`; what is left then is dropped, and counted in a WARNING.
* **Order per resource within an instance**: a resource's events run one after another, in
  stream order; different resources run concurrently (at most `Settings.concurrency`). There
  is no order *across* instances: each runs at its own pace.
* **Trimmed before read, never silently**: an instance that falls behind the stream's cap
  (``MAXLEN ~``, or the offloader's trim) reads on from the stream's new head; the entries
  trimmed before it read them never reach it. `Gaps` counts them, from the stream's
  ``entries-added`` and the instance's own count of entries read (what a group's
  ``entries-read`` is to `eventbus.consumer.trims`), logs them at ERROR and counts them in
  ``eventbus_trimmed_unread_total`` (group label ``_broadcast[.<group>]``, per instance).
* **No fencing**: the `Context.fencing_token` is 0 (nothing is locked).
* Control entries (the operator's requeue/drop for groups) are not events: never handed to a
  handler, a catch-all one included.

The assembly: an open ownership (`open_ownership.OpenOwnership`: every shard, no lock, no lease,
a fence that always holds, its own read positions) and a group's pipeline stages
(`pipeline.Stages`): the handling path (decoded and validated per read, the retry policy, the
watchdog's timeouts), per-resource queues run by a pool of workers, and the count of entries in
flight (`acks`, as for ``NOACK`` reads: nothing is sent); only the last step differs (`Drops`:
dropped, not dead-lettered), and the reads are plain ``XREAD`` from the positions.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from eventbus.client import retry
from eventbus.client.retry import LOST_REPLY
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery, Fence, Outcome, Tally
from eventbus.consumer.handling import Handling
from eventbus.consumer.open_ownership import OpenOwnership
from eventbus.consumer.pipeline import Stages, per_resource
from eventbus.consumer.supervision import start_when_reachable
from eventbus.locking.member import Member
from eventbus.protocol.topics import TopicRegistry

log = logging.getLogger("eventbus.consumer")

_BATCH = 500  # entries per stream per XREAD
_RETRIED: tuple[type[Exception], ...] = (*LOST_REPLY, ResponseError)  # reads start over


class Drops:
    """The failure policy of a broadcast subscriber: nothing is dead-lettered or parked; an
    entry that cannot be handled is logged and dropped (`dropped` counts them)."""

    def __init__(self, sub: Subscription, tally: Tally) -> None:
        self.sub, self.tally = sub, tally
        self.dropped = 0
        self.parked: dict[str, str] = {}  # never any: nothing is parked

    def gives_up(self, parking: bool) -> str:
        return "dropped"  # (a broadcast subscriber has no dead-letter stream)

    async def dead_letter(
        self, d: Delivery, exc: BaseException | None, *, reason: str, fence: Fence
    ) -> Outcome:
        self.dropped += 1
        if reason != "failed":  # a failed one was logged at ERROR by `Handling.gave_up`
            log.warning(
                "broadcast %s: entry %s of shard %d is %s, dropped: %s",
                self.sub.topic.name,
                d.entry_id.decode(),
                d.shard,
                reason,
                exc,
            )
        return Outcome.ACK

    async def dead_letter_and_park(
        self, d: Delivery, exc: BaseException, resource_id: str, fence: Fence
    ) -> Outcome:
        return await self.dead_letter(d, exc, reason="failed", fence=fence)

    async def control(self, d: Delivery, fence: Fence, handling: Handling) -> Outcome:
        return Outcome.ACK  # the operator's requests are for consumer groups

    def is_parked(self, resource_id: str) -> bool:
        return False

    async def load_parked(self) -> None:
        return None


class BroadcastConsumer:
    """Runs one broadcast `Subscription` until stopped; see the module docstring. Its parts:
    `ownership` (open) and the pipeline's `stages` (per-resource queues; `handling` with
    `Drops` as its failure policy; `acks`, the count of entries in flight, nothing sent)."""

    def __init__(self, member: Member, registry: TopicRegistry, sub: Subscription) -> None:
        """`member` names this instance (its topic and group are `sub`'s); `registry` checks the
        topic's shard count."""
        settings = self.settings = member.settings
        self.redis, self.consumer_id, self.group = member.redis, member.consumer_id, member.group
        self.registry, self.sub, self.topic = registry, sub, sub.topic
        own = self.ownership = OpenOwnership(member, sub)
        self.lease = own  # readiness (`Running.lease`): it reads once its positions are taken
        self.started, self.gaps, self.mark_reads = own.started, own.gaps, own.mark_reads
        self.backoff = retry.backoff(settings.retry_base_s, settings.retry_max_s)
        self.drops: Drops | None = None
        # a group's stages, fenced by the open ownership; entries are finished when handled
        # (or dropped): acked as NOACK reads are, nothing sent
        stages = self.stages = Stages(
            member,
            sub,
            own,
            own.table,
            None,
            noack=True,
            queues=per_resource,
            failures=self._drops,
            backoff=self.backoff,
        )
        self.handling, self.acks = stages.handling, stages.acks
        self.tally = stages.tally  # dead_lettered stays 0: no dead-letter stream here

    def _drops(self, tally: Tally) -> Drops:
        self.drops = Drops(self.sub, tally)
        return self.drops

    @property
    def dropped(self) -> int:
        """Entries not handled: failed after their retries, undecodable, unknown."""
        return self.drops.dropped if self.drops else 0

    @property
    def in_flight(self) -> int:
        """Entries read and not yet handled (or dropped)."""
        return self.acks.in_flight

    # -- running --------------------------------------------------------------------------------
    async def run(self, stop: anyio.Event) -> None:
        """Read and handle until `stop` is set; what was read is still handled for at most
        `shutdown_grace_s` seconds, the rest is dropped (not this instance's any more). A lost
        connection at start is retried until Redis answers or `stop` is set (then it returns,
        `started` set: there is nothing to wait for: `start_when_reachable`)."""
        waits = retry.Waits(self.backoff, log)
        who = f"broadcast consumer {self.consumer_id}"
        if not await start_when_reachable(self._start, stop, waits, who):
            self.started.set()
            return
        log.info(
            "broadcast consumer %s starts on topic %s (%d shards)",
            self.consumer_id,
            self.topic.name,
            self.topic.shards,
        )
        # One XREAD of every shard stream on a single node; on a Cluster one per stream, each
        # on its own connection: the keys of one XREAD must share a hash slot there.
        streams = self.ownership.table.streams
        reads = [[s] for s in streams] if self.settings.cluster else [streams]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.handling.watchdog.run)
                self.stages.queues.start_workers(
                    lambda: tg.start_soon(self.stages.worker, tg), self.settings.concurrency
                )
                async with anyio.create_task_group() as readers:
                    readers.start_soon(self._cancel_reads_on, stop, readers.cancel_scope)
                    for these in reads:
                        readers.start_soon(self._read_loop, these, stop)
                with anyio.move_on_after(self.settings.shutdown_grace_s):
                    await self._last_check()
                    while self.acks.in_flight:
                        await self.acks.wait_idle()
                tg.cancel_scope.cancel()
        finally:
            self.handling.flush_metrics()
        if self.in_flight:
            log.warning(
                "broadcast consumer %s stopped with %d events read and not handled within "
                "shutdown_grace_s=%.1f s: dropped",
                self.consumer_id,
                self.in_flight,
                self.settings.shutdown_grace_s,
            )

    async def _read_loop(self, streams: list[str], stop: anyio.Event) -> None:
        """Read `streams` from their positions into the queues until `stop` is set (then the
        task group's cancellation ends a blocked read), at most `max_in_flight` entries
        unfinished."""
        own, acks, settings = self.ownership, self.acks, self.settings
        waits = retry.Waits(self.backoff, log)
        behind = False  # whether trimming may have caught up with the position (`Gaps`)
        while not stop.is_set():
            while acks.in_flight >= settings.max_in_flight:
                behind = True  # not reading, while the stream may grow past its cap
                await own.table.changed()  # (`Acks` wakes it once back under the cap)
            try:
                if behind or own.gaps.due(streams, settings.trim_check_s):
                    await own.check_gaps(streams)
                positions: dict[KeyT, StreamIdT] = {s: own.positions[s] for s in streams}
                reply = await self.redis.xread(positions, count=_BATCH, block=settings.block_max_ms)
                waits.ok()
            except _RETRIED as exc:
                await waits.wait(stop, f"broadcast consumer {self.consumer_id}: read failed", exc)
                continue
            self._dispatch(reply or [])
            self.handling.flush_metrics()
            behind = any(len(entries) >= _BATCH for _, entries in reply or [])  # more to read

    def _dispatch(self, reply: list[Any]) -> None:
        own = self.ownership
        for stream, entries in reply:
            key = stream.decode() if isinstance(stream, bytes) else stream
            self.stages.dispatch(own.by_stream[key], entries, None)
            if entries:
                own.read(key, entries)

    async def _cancel_reads_on(self, stop: anyio.Event, scope: anyio.CancelScope) -> None:
        """A blocking XREAD does not wait for its block time once `stop` is set, nor does a
        handler retry (`wait_retry`): within the grace it is tried at once, not dropped."""
        await stop.wait()
        self.handling.stopping.set()
        scope.cancel()

    async def _last_check(self) -> None:
        """At stop, once reading ended: tell the entries trimmed since the last check."""
        try:
            await self.ownership.check_gaps(self.ownership.table.streams)
        except _RETRIED as exc:
            log.warning(
                "broadcast consumer %s: could not check for entries trimmed before it read "
                "them at stop: %s",
                self.consumer_id,
                exc,
            )

    async def _start(self) -> None:
        await self.registry.ensure(self.topic)
        await self.ownership.start()
