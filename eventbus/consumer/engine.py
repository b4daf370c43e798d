"""One consumer of one (topic, group): lock -> recover -> read -> process in order -> ack -> unlock.

The life of a round (`Consumer.round`):

1. **Acquire**: ``lock_shards.lua`` refreshes this consumer's liveness and takes shard locks up to
   the fair share ``ceil(shards / live consumers)`` (`eventbus.locking.locks`). Steps 1-5 run at
   most every `lock_interval_ms` (at once when no shard is held or the lease ran out); the rounds
   between them read the shards held.
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
import random
import time
from typing import Any

import anyio
import anyio.abc

from eventbus.client import retry
from eventbus.consumer.acks import Acks
from eventbus.consumer.batching import batch_queues, is_batch
from eventbus.consumer.catching_up import CatchUpHook, CatchUpSchedule
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery
from eventbus.consumer.handling import Handling
from eventbus.consumer.queues import ResourceQueues
from eventbus.consumer.reading import Counts, Entries, Reader
from eventbus.consumer.runner import QueueRunner
from eventbus.consumer.shards import HeldShard, ShardTable, read_items
from eventbus.consumer.supervision import read_loop, refused, start_when_reachable
from eventbus.consumer.trims import TrimWatch
from eventbus.errors import RedisCommandRefused
from eventbus.locking.lease import Lease, heartbeat_loop
from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts
from eventbus.ops.metrics import METRICS, ShardMetrics
from eventbus.profiles import EVENTBUS
from eventbus.protocol.retention import trim_held_to_acked
from eventbus.protocol.topics import TopicRegistry
from eventbus.tier.settings import OFFLOADER_GROUP

log = logging.getLogger("eventbus.consumer")


class Consumer:
    """Runs one `Subscription` until stopped. Created by `EventBus.run`; one per subscription.
    It is the `Fence` of the entries it handles (`holds`, `wait`)."""

    def __init__(
        self,
        member: Member,
        registry: TopicRegistry,
        sub: Subscription,
        scripts: Scripts | None = None,
    ) -> None:
        """`member` names this consumer (its topic and group are `sub`'s); `registry` checks the
        topic's shard count; `scripts` are the lock scripts to share (default: registered)."""
        settings = member.settings
        self.member, self.settings, self.registry = member, settings, registry
        self.redis, self.keys, self.consumer_id = member.redis, member.keys, member.consumer_id
        self.sub, self.topic, self.group = sub, sub.topic, sub.group
        self.noack = sub.options.ack == "before"
        self.catch_up: CatchUpHook | None = None  # set by EventBus.run when it has an archive
        self.backoff = retry.backoff(settings.retry_base_s, settings.retry_max_s)
        n = self.topic.shards
        self.locks = (member.profile or EVENTBUS).lock_client(member, n, scripts)
        self.lease = Lease(settings.lease_s)
        self.table = ShardTable([self.keys.stream(self.topic.name, s) for s in range(n)])
        count = member.settings.read_count
        if is_batch(sub.call):  # full batches: a read as large as a batch
            count = max(count, sub.call.max_batch)
        self.reader = Reader(member, self.table.streams, noack=self.noack, count=count)
        redis_retry = retry.forever(settings.retry_base_s, settings.retry_max_s)
        self.handling = Handling(
            member,
            sub,
            redis_retry,
            fenced_off=self._fenced_off,
            # (a custom lock client written before `ShardLocks.fences_writes`: cannot fence)
            fence_in_redis=getattr(self.locks, "fences_writes", False),
        )
        self.acks = Acks(
            member,
            self.table,
            self.lease,
            noack=self.noack,
            backoff=self.backoff,
            before_send=self.handling.flush_metrics,  # an entry's metrics before its ack
        )
        self.acks.on_refused = self.refused_metric
        # The per-shard read-ahead bound: a shard is read only while at most one read's worth
        # (`count`) of its entries is in flight, so at most two reads' worth is: one handled,
        # the next read meanwhile. One hot shard cannot take all of `max_in_flight`, and what
        # a draining shard must finish before its release, or a crash leaves to XAUTOCLAIM,
        # does not grow with `max_in_flight` (docs/operations.md, max_in_flight). NOACK reads
        # lose what they read ahead when the consumer stops or loses its lease: a shard of
        # theirs is read again only once its last read is finished, so at most `count` x held
        # shards are lost (docs/semantics.md, at-most-once).
        self.shard_room = 0 if self.noack else count
        self.acks.shard_room = self.shard_room
        self.queues = ResourceQueues(self.acks.started)
        self.trims = TrimWatch(member)
        self.tally = self.handling.tally  # handled, dead-lettered, duplicates skipped
        self._rotation = random.randrange(n)
        self._next_lock = 0.0  # monotonic time of the next lock round (`_lock_due`)
        self._share = 0  # the fair share of the last lock round
        self._unusable: set[int] = set()  # shards whose unusable lock key was reported
        self._owed_until = 0.0  # monotonic time until which a consumer holding none polls fast
        self.read_full = False  # the last read filled a shard's read_count (`read_linger_ms`)
        self.catching_up = CatchUpSchedule(self.backoff)
        self._stopping = False  # set at the stop: no more reads
        self._letting_go = False  # set at the stop of an at-least-once consumer: none starts
        self._stopped = self.handling.stopping  # set then too (retry waits end at once)
        self.runner = QueueRunner(self.handling, self, self.acks)
        self._work: Any = self.runner.run  # a worker's step: a resource's queue, or a batch
        self._batch = is_batch(sub.call)
        if self._batch:
            self.queues, self._work = batch_queues(
                self.handling, self, self.runner.process, self.acks
            )
        self._joined = anyio.Event()  # set by the first lock round: then heartbeats start
        self._handled_reported = 0
        self._m_handled = METRICS.handled.labels(self.topic.name, self.group)
        self._m_lease = METRICS.lease_lost.labels(self.topic.name, self.group)
        self._m_shards = ShardMetrics(self.topic.name, self.group)

    @property
    def in_flight(self) -> int:
        """Entries read (or claimed) and not yet finished: acked, or let go unacked."""
        return self.acks.in_flight

    # -- lifecycle ------------------------------------------------------------------------------
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
        waits = retry.Waits(self.settings.retry_base_s, self.settings.retry_max_s, log)
        if not await start_when_reachable(self._start, stop, waits, f"consumer {self.consumer_id}"):
            await self.reader.aclose()
            return
        log.info(
            "consumer %s starts on topic %s group %s (%d shards)",
            self.consumer_id,
            self.topic.name,
            self.group,
            self.topic.shards,
        )
        ttl = self.settings.liveness_ttl_s
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    heartbeat_loop, self.locks, ttl, self._joined, self.lease.renew, self._expired
                )
                tg.start_soon(self.acks.loop)
                tg.start_soon(self.handling.watchdog.run)
                for _ in range(self.settings.concurrency):
                    tg.start_soon(self._worker, tg)
                tg.start_soon(self._stop_starting, stop)
                await read_loop(self, stop)
                await self.acks.drain(
                    self.settings.shutdown_grace_s, self.handling.watchdog.running
                )
                tg.cancel_scope.cancel()
        finally:
            self._report_handled()
            with anyio.CancelScope(shield=True):
                await self._leave()
                await self.reader.aclose()

    async def _start(self) -> None:
        await self.registry.ensure(self.topic)
        await self.reader.ensure_groups()

    async def _stop_starting(self, stop: anyio.Event) -> None:
        """Once `stop` is set, read no more and, at once, start no more handlers: the read loop
        may still be in a blocking read for a while, and queued entries must not keep running
        meanwhile, or a large backlog would delay the hand-over (they stay pending for the next
        owner). An at-most-once consumer's entries were acknowledged when read (``NOACK``): it
        handles what it read, the read in flight at the stop included, within
        `shutdown_grace_s`, instead of dropping it (hunt33b)."""
        await stop.wait()
        self._stopping = True
        self.handling.halting.set()
        if not self.noack:
            self._letting_go = True
            self._stopped.set()
        self._wake_all()

    async def _leave(self) -> None:
        held = sorted(self.table.held)
        try:
            await self.locks.release(held, leave=True)
            log.info("consumer %s left; released shards %s", self.consumer_id, held)
        except retry.LOST_REPLY as exc:
            log.error(
                "consumer %s could not release its locks (%s); they free up after the liveness "
                "TTL of %.1f s",
                self.consumer_id,
                exc,
                self.settings.liveness_ttl_s,
            )
        self.table.clear()

    # -- the fence ------------------------------------------------------------------------------
    def holds(self, d: Delivery) -> bool:
        # per event: two attribute reads and a clock read (d is one of our `Item`s)
        return (
            time.monotonic() < self.lease.until
            and not d.held.lost  # type: ignore[attr-defined]
            and not self._letting_go
        )

    async def wait(self, d: Delivery) -> bool:
        while not self.lease.ok():
            if not self._current(d):
                return False
            await self.lease.changed()
        return self._current(d)

    def _current(self, d: Delivery) -> bool:
        return not self._letting_go and not d.held.lost  # type: ignore[attr-defined]

    def _fenced_off(self, d: Delivery) -> None:
        """Redis refused a fenced write for `d` (``fenced_hash.lua``): the lock of its shard
        moved on. Forget the shard now if it is still held under `d`'s acquisition, so that
        nothing more of it is read or started (review32 F4); the next lock round sees who
        holds it."""
        if self.table.current(d.shard, d.generation):
            log.warning(
                "consumer %s drops shard %d: Redis refused a fenced write, its lock moved on",
                self.consumer_id,
                d.shard,
            )
            self.table.forget([d.shard])
            self._wake_all()

    def _expired(self) -> None:
        self.drop_all("liveness had expired before this heartbeat")

    def drop_all(self, reason: str, *, lease: bool = True) -> None:
        """Forget every held shard: queued items and unsent acks of them are dropped and their
        entries stay pending, to be recovered by whoever holds the lock next (maybe us)."""
        if self.table.held:
            log.warning(
                "consumer %s drops shards %s: %s", self.consumer_id, sorted(self.table.held), reason
            )
            if lease:
                self._m_lease.inc()
        self.table.clear()
        self._wake_all()

    def _wake_all(self) -> None:
        self.lease.wake()
        self.acks.wake_capacity()

    # -- processing -----------------------------------------------------------------------------
    async def _worker(self, tg: anyio.abc.TaskGroup) -> None:
        """One of the `concurrency` workers, with its own watchdog slot."""
        await self.queues.worker(self._work, self.handling.watchdog.slot(), tg, self._stopped)

    # -- the round ------------------------------------------------------------------------------
    async def round(self, block_ms: int) -> bool:
        """One acquire/apply/catch-up/recover/surplus/read/release round (the first five at
        most every `lock_interval_ms`). Returns whether any entry was read."""
        self._report_handled()  # before the trim check's lag gauges and the blocking read
        if self._lock_due():
            await self._lock_round()
        await self._check_trims()
        if self._stopping:  # stopped meanwhile: no read after the stop (the workers let the
            return False  # queued entries go, so every shard looks readable)
        got = await self._read(block_ms)
        if got is None:  # no lease: re-lock in the next round
            return False
        idle = self.table.to_release(got, time.monotonic(), self.settings.idle_release_ms / 1000)
        if idle:
            await self._release(idle)
        self._report_handled()
        return bool(got)

    def _lock_due(self) -> bool:
        """Whether this round starts with a lock round: `lock_interval_ms` after the last one,
        or at once when no shard is held or the lease ran out. Between lock rounds the held
        shards are read under the lease that heartbeats keep (`lease`); a consumer reading a
        trickle of events would otherwise run ``lock_shards.lua`` on the hashtag's node for
        every few events."""
        return time.monotonic() >= self._next_lock or not self.table.held or not self.lease.ok()

    async def _lock_round(self) -> None:
        """Acquire, apply the grants, catch up and recover newly held shards, mark surplus."""
        n = self.topic.shards
        self._next_lock = time.monotonic() + self.settings.lock_interval_ms / 1000
        with refused("EVALSHA lock_shards", self.topic.name):
            grants = await self.locks.acquire([(self._rotation + i) % n for i in range(n)])
        self._rotation = (self._rotation + 1) % n
        self.lease.renew(grants.sent_at)
        lost, new = self.table.apply(grants.grants)
        if new or not self._joined.is_set():  # joined, or shards are coming: more may follow
            self._owed_until = time.monotonic() + self.settings.block_max_ms / 1000
        self._joined.set()
        self._m_shards.round(*grants.taken(new), len(lost), len(self.table.held))
        if grants.unusable or self._unusable:
            self._report_unusable(grants.unusable)
        for s in lost:
            log.warning("consumer %s lost shard %d to another consumer", self.consumer_id, s)
        if new and self.sub.options.on_failure == "park":
            try:  # parked by a previous owner? Not known: the new shards are not read
                with refused("HGETALL", self.keys.parked(self.topic.name, self.group)):
                    await self.handling.failures.load_parked()
            except BaseException:
                self.table.forget(new)
                raise
        # Whatever state the lock was in, a new owner claims the shard's pending entries first:
        # a free lock is not a clean shard, since a consumer that left gracefully leaves the
        # entries it had read but not started pending. (NOACK reads leave no pending entries,
        # but a NOACK group behind the archive is caught up all the same: hunt33.)
        recover = new
        if recover and self.catch_up is not None:
            recover = await self._catch_up(recover)
        if recover and not self.noack:
            await self._recover(recover)
        self.table.mark_surplus(grants.share)
        self._share = grants.share

    async def _recover(self, shards: list[int]) -> None:
        """Recover the PEL of newly held `shards`, only under a valid lease (``XAUTOCLAIM`` is
        not fenced by Redis: a lock round answered after its lease ran out could take entries of
        a shard someone else holds by then). If the lease ran out or the recovery fails, they
        are forgotten, so that they are not read past their pending entries and the next round
        recovers them again."""
        if not self.lease.ok():  # the lock round's reply came after its lease: claim nothing
            self.table.forget(shards)  # (the next lock round takes them again, then recovers)
            return
        held = [self.table.held[s] for s in shards if s in self.table.held]
        try:
            with refused("XAUTOCLAIM", ",".join(h.stream for h in held)):
                await self.reader.recover(held, self._dispatch, self._still_held)
        except BaseException:
            self.table.forget(shards)
            raise

    def _still_held(self, h: HeldShard) -> bool:
        return self.table.held.get(h.shard) is h and self.lease.ok()

    async def _read(self, block_ms: int) -> set[int] | None:
        """Read the readable shards into the queues; the shards that had entries, or None when
        the read was skipped for want of a lease.

        XREADGROUP is not fenced by Redis: a read sent after the lease ran out (a process paused
        past its TTL) would pull entries of shards now owned by others into our PEL, and their
        owner would read past them. So read only with a lease, blocking no longer than it lasts;
        without one, skip the read and re-lock in the next round."""
        readable = self.table.readable(self.shard_room)
        active = len(self.table.readable())  # held and not draining
        if not readable:  # nothing to read (all draining or full, or none held): wait a poll
            behind = any(h.behind for h in self.table.held.values())
            with anyio.move_on_after(self._poll_ms(block_ms) / 1000):
                if active or behind:  # until a full shard has room, or one behind drained
                    await self.acks.wait_capacity()
                else:
                    await anyio.sleep_forever()
            return set()
        if len(readable) < active:  # a full shard gets room while the read blocks: not long
            block_ms = min(block_ms, self.settings.block_min_ms)
        lease_ms = self.lease.remaining_ms() - 5
        if lease_ms < 1:
            return None
        got = set()
        with refused("XREADGROUP", ",".join(h.stream for h in readable)):
            reads = await self.reader.read(readable, min(block_ms, lease_ms))
        count = self.settings.read_count
        self.read_full = any(len(read.entries) >= count for read in reads)
        for read in reads:
            held = self.table.of_stream(read.stream)
            if held is not None:
                got.add(held.shard)
                self._dispatch(held, read.entries, read.counts)
        return got

    def _poll_ms(self, block_ms: int) -> int:
        """How long a round that has no shard to read waits before the next: the read loop's
        BLOCK, which doubles while rounds get nothing, but no more than `lock_interval_ms` while
        this consumer holds none, the last lock round gave it a share, and it joined or was
        granted a shard less than `block_max_ms` ago (a consumer joining a busy group: the
        others release its shards once they have drained them, and it took them up to the 1 s
        of `block_max_ms` late). The lock round does not tell whether any shard is owed to it:
        a share of 1 is also every standby's when members outnumber shards, and a standby that
        kept polling every `lock_interval_ms` ran 10 lock rounds a second for ever (review30
        F2); after the window it backs off with the BLOCK, never later than it was."""
        if not self.table.held and self._share and time.monotonic() < self._owed_until:
            return min(block_ms, self.settings.lock_interval_ms or block_ms)
        return block_ms

    def _dispatch(self, held: HeldShard, entries: Entries, counts: Counts) -> None:
        """Queue what one read (or one page of recovery) got from `held`'s stream, decoded and
        validated in one pass first (`Handling.prepare`). A batch subscription's entries are
        queued as read and prepared by the worker, one batch at a time (`BatchRunner.run`):
        its queues are keyed by shard, not by the resource the decode finds, and the read loop
        sends its next read while the workers decode, instead of after."""
        items = read_items(held, entries, counts)
        if not self._batch:
            self.handling.prepare(items)
        self.queues.dispatch(held, items)

    async def _check_trims(self) -> None:
        """Check the held shards that are due for entries trimmed before the group read them
        (`trims`), before reading past them; with an archive, a shard found trimmed ahead, or
        one whose trims Redis cannot count while its group's position lies before the stream's
        first entry (`TrimCheck.uncounted`), is marked `behind`: not read again until its
        entries in flight (all older than the gap) are finished and the catch-up hook has
        handled the gap, one after the other, as the resources' order needs
        (`_catch_up_behind`)."""
        due = self.trims.due(list(self.table.held.values()), time.monotonic())
        if due:
            await self._check_due(due)
        if self.catch_up is not None:
            await self._catch_up_behind()

    async def _check_due(self, due: list[HeldShard]) -> None:
        with refused("XINFO / XADD (trim check)", ",".join(h.stream for h in due)):
            checked = await self.trims.check(due)
        if self.catch_up is not None:  # the hook tells, from the archive, what was trimmed
            for s in [t.shard for t in checked.found if t.ahead] + checked.uncounted:
                if (held := self.table.held.get(s)) is not None:
                    held.behind = True
        if self.topic.retention == "acked":
            await self._trim_to_acked(due)

    async def _trim_to_acked(self, due: list[HeldShard]) -> None:
        """Trim the `due` shards to what every group acked (``retention="acked"``). A refused
        trim (NOPERM without the trimming role, OOM...) is logged at ERROR and counted, and the
        round goes on: the reads do not depend on it, and failing the round for it kept every
        shard unread while the error lasted (review32 F3)."""
        streams = {h.shard: h.stream for h in due}
        try:
            with refused("XTRIM (retention=acked)", ",".join(streams.values())):
                await trim_held_to_acked(
                    self.redis,
                    self.keys.checkpoints(self.topic.name),
                    streams,
                    archived=self.catch_up is not None,  # the bus has an archive
                    exact=self.settings.retention_trim_exact,
                    offloader_locks=self.keys.locks(self.topic.name, OFFLOADER_GROUP),
                )
        except RedisCommandRefused as exc:
            self.refused_metric(exc.command)
            log.error("consumer %s: %s; the shards are read on, untrimmed", self.consumer_id, exc)

    async def _catch_up_behind(self) -> None:
        """Catch up the shards marked `behind` whose entries in flight are all finished (the
        hook handles their PEL too: nothing of it may still be queued or running), whatever
        their last check (`CatchUpSchedule.run`); they are read again after."""
        ready = [h.shard for h in self.table.held.values() if h.behind and not h.in_flight]
        if not ready:
            return
        assert self.catch_up is not None
        for s in await self.catching_up.run(self.catch_up, ready, self.table, self._release):
            if (held := self.table.held.get(s)) is not None:  # (not dropped meanwhile)
                held.behind = False

    async def _release(self, shards: list[int]) -> None:
        with refused("EVALSHA unlock_shards", self.topic.name):
            await self.locks.release(shards)
        self.table.forget(shards)

    async def _catch_up(self, shards: list[int]) -> list[int]:
        """Let the catch-up hook handle what the group missed in newly locked `shards` before
        they are read (`CatchUpSchedule.run`); returns the shards still held."""
        assert self.catch_up is not None
        return await self.catching_up.run(self.catch_up, shards, self.table, self._release)

    def _report_unusable(self, unusable: dict[int, str]) -> None:
        """Say, once per shard (not per round) until its lock key can be read again, that a
        shard is not handled because the lock script could not read its lock key (a Verse lock
        key of another type: `LockRound.unusable`); counted as a refused ``EVALSHA
        lock_shards``. The other shards are handled as usual."""
        for s in sorted(unusable.keys() - self._unusable):
            log.error(
                "consumer %s: shard %d of topic %r is not handled: its lock key is unusable "
                "(%s); delete or repair the key and the shard is taken in the next lock round",
                self.consumer_id,
                s,
                self.topic.name,
                unusable[s],
            )
            self.refused_metric("EVALSHA lock_shards")
        for s in sorted(self._unusable - unusable.keys()):
            log.warning("consumer %s: shard %d's lock key is usable again", self.consumer_id, s)
        self._unusable = set(unusable)

    def refused_metric(self, command: str) -> None:
        METRICS.redis_refusals.labels(self.topic.name, self.group, command).inc()

    def _report_handled(self) -> None:
        """Add the handler successes since the last call to the Prometheus counter, and the
        latencies and durations to their histograms (once a round rather than once an event: a
        labelled increment costs a few microseconds)."""
        self.handling.flush_metrics()
        handled = self.tally.handled
        self._m_handled.inc(handled - self._handled_reported)
        self._handled_reported = handled
