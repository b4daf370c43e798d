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
a fence that always holds, its own read positions, its trim check telling the gaps) and a
group's pipeline (`pipeline.Pipeline`, its rounds run by the same read loop,
`supervision.read_loop`) reading with plain ``XREAD`` from the positions
(`position_reads.PositionReader`) instead of ``XREADGROUP``: the handling path (decoded and
validated per read, the retry policy, the watchdog's timeouts), per-resource queues run by a pool
of workers, and the count of entries in flight (`acks`, as for ``NOACK`` reads: nothing is
sent). What differs is here: the last step (`Drops`: dropped, not dead-lettered) and the stop
(the blocked read ended at once, the gaps told once more, what is left after the grace dropped).
"""

from __future__ import annotations

import logging

import anyio
from redis.exceptions import ResponseError

from eventbus.client import retry
from eventbus.client.retry import LOST_REPLY
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery, Fence, Outcome, Tally
from eventbus.consumer.handling import Handling
from eventbus.consumer.open_ownership import OpenOwnership
from eventbus.consumer.pipeline import Pipeline, per_resource
from eventbus.consumer.position_reads import PositionReader
from eventbus.consumer.supervision import count_refusals, read_loop, start_when_reachable
from eventbus.locking.member import Member
from eventbus.protocol.topics import TopicRegistry

log = logging.getLogger("eventbus.consumer")

_CHECK_FAILED: tuple[type[Exception], ...] = (*LOST_REPLY, ResponseError)  # the last gap check


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
    `ownership` (open) and the `pipeline` (`PositionReader`; per-resource queues; `handling`
    with `Drops` as its failure policy; `acks`, the count of entries in flight, nothing sent)."""

    def __init__(self, member: Member, registry: TopicRegistry, sub: Subscription) -> None:
        """`member` names this instance (its topic and group are `sub`'s); `registry` checks the
        topic's shard count."""
        settings = self.settings = member.settings
        self.consumer_id, self.group = member.consumer_id, member.group
        self.registry, self.sub, self.topic = registry, sub, sub.topic
        refusals = count_refusals(self.topic.name, self.group)
        own = self.ownership = OpenOwnership(member, sub, refusals)
        self.lease = own  # readiness (`Running.lease`): it reads once its positions are taken
        self.started, self.gaps, self.mark_reads = own.started, own.gaps, own.mark_reads
        self.drops: Drops | None = None
        count = settings.read_count
        self.pipeline = Pipeline(
            member,
            sub,
            own,
            PositionReader(member, own, count=count),
            count=count,
            queues=per_resource,
            failures=self._drops,
            catch_up=None,
            backoff=retry.backoff(settings.retry_base_s, settings.retry_max_s),
            on_refused=refusals,
        )
        self.handling, self.acks = self.pipeline.handling, self.pipeline.acks
        self.tally = self.pipeline.tally  # dead_lettered stays 0: no dead-letter stream here

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
        pipe, settings = self.pipeline, self.settings
        waits = retry.Waits(retry.backoff(settings.retry_base_s, settings.retry_max_s), log)
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
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe.handling.watchdog.run)
                pipe.queues.start_workers(
                    lambda: tg.start_soon(pipe.worker, tg), settings.concurrency
                )
                with anyio.CancelScope() as reading:
                    tg.start_soon(self._end_reads_on, stop, reading)
                    await read_loop(pipe, self.ownership, self.registry, stop)
                with anyio.move_on_after(settings.shutdown_grace_s):
                    await self._last_check()
                    while self.acks.in_flight:
                        await self.acks.wait_idle()
                tg.cancel_scope.cancel()
        finally:
            pipe.report_handled()
        if self.in_flight:
            log.warning(
                "broadcast consumer %s stopped with %d events read and not handled within "
                "shutdown_grace_s=%.1f s: dropped",
                self.consumer_id,
                self.in_flight,
                settings.shutdown_grace_s,
            )

    async def _end_reads_on(self, stop: anyio.Event, reading: anyio.CancelScope) -> None:
        """At `stop`, read no more (`Pipeline.stop_starting`) and end a blocked ``XREAD`` at
        once: it holds nothing (`position_reads`). A handler retry waiting then (`wait_retry`)
        is tried at once, within the grace, not dropped."""
        await self.pipeline.stop_starting(stop)
        self.handling.stopping.set()
        reading.cancel()

    async def _last_check(self) -> None:
        """At stop, once reading ended: tell the entries trimmed since the last check."""
        try:
            await self.ownership.check_gaps(self.ownership.table.streams)
        except _CHECK_FAILED as exc:
            log.warning(
                "broadcast consumer %s: could not check for entries trimmed before it read "
                "them at stop: %s",
                self.consumer_id,
                exc,
            )

    async def _start(self) -> None:
        await self.registry.ensure(self.topic)
        await self.ownership.start()
