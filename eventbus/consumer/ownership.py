"""What a group consumer owns: its shard locks, and the fence of every entry it handles.

`Ownership` runs the lock round (``lock_shards.lua``: liveness, locks up to this consumer's fair
share, ``floor(shards / live consumers)`` or one more), keeps the lease (`eventbus.locking.lease`)
and the held-shard table (`shards`), checks the held shards for trimmed entries (`trims`),
schedules their catch-up from the durable tier (`catching_up`), has the pending entries of newly
held shards recovered first, releases idle and surplus shards, and at the end releases every lock
and leaves the group. It is the `Fence`: an entry is handled only while its shard is held under the
acquisition it was read in and the lease is valid (docs/semantics.md).

It knows nothing of how entries are read, decoded, queued or acked: the pipeline
(`eventbus.consumer.pipeline`) hands itself in as the `Claimer` at each round: it loads the
parked resources, claims a new shard's PEL into its queues, and has the catch-up hook.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Protocol

import anyio
from redis.backoff import AbstractBackoff

from eventbus.client import retry
from eventbus.consumer.catching_up import CatchUpHook, CatchUpSchedule
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery
from eventbus.consumer.shards import HeldShard, ShardTable
from eventbus.consumer.supervision import refused, report_unusable
from eventbus.consumer.trims import TrimWatch
from eventbus.errors import RedisCommandRefused
from eventbus.locking.lease import Lease
from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts
from eventbus.ops.metrics import METRICS, ShardMetrics
from eventbus.protocol.retention import trim_held_to_acked
from eventbus.tier.settings import OFFLOADER_GROUP

log = logging.getLogger("eventbus.consumer")

OWED_ROUNDS = 4
"""Lock rounds per `lock_interval_ms` of a consumer owed shards, for `block_max_ms` after it
joined or was granted one (`Ownership.lock_due`, `poll_ms`)."""


class Claimer(Protocol):
    """What a round asks of the pipeline for the shards it newly holds or finds behind."""

    catch_up: CatchUpHook | None
    """The durable tier's hook for a group behind Redis's first entry (None: no archive)."""

    async def load_parked(self) -> None:
        """Load the resources parked by a previous owner (``on_failure="park"``), before any
        new shard is read."""

    async def claim(self, held: list[HeldShard], still_held: Callable[[HeldShard], bool]) -> None:
        """Claim the pending entries of `held` (``XAUTOCLAIM``) into the queues, while
        `still_held`."""


class Ownership:
    """The shard locks of one group consumer (`member`, `sub`) and the fence of its entries
    (`holds`, `wait`). `scripts`: the lock scripts to share (default: registered); `backoff`
    spaces failed catch-ups; `on_refused(command)` counts a refused command."""

    def __init__(
        self,
        member: Member,
        sub: Subscription,
        *,
        scripts: Scripts | None,
        backoff: AbstractBackoff,
        on_refused: Callable[[str], None],
    ) -> None:
        settings = self.settings = member.settings
        self.redis, self.keys, self.consumer_id = member.redis, member.keys, member.consumer_id
        self.sub, self.topic, self.group = sub, sub.topic, sub.group
        self.noack = sub.options.ack == "before"
        self.on_refused = on_refused
        n = self.topic.shards
        self.locks = member.profile.lock_client(member, n, scripts)
        self.lease = Lease(settings.lease_s)
        self.table = ShardTable([self.keys.stream(self.topic.name, s) for s in range(n)])
        self.trims = TrimWatch(member)
        self.catching_up = CatchUpSchedule(backoff)
        self.joined = anyio.Event()  # set by the first lock round: then heartbeats start
        self.letting_go = False  # set at the stop of an at-least-once consumer: none starts
        self._rotation = random.randrange(n)
        self._next_lock = 0.0  # monotonic time of the next lock round (`lock_due`)
        self.share = 0  # the fair share of the last lock round
        self._unusable: set[int] = set()  # shards whose unusable lock key was reported
        self.owed_until = 0.0  # monotonic time until which a consumer holding none polls fast
        self._m_lease = METRICS.lease_lost.labels(self.topic.name, self.group)
        self._m_shards = ShardMetrics(self.topic.name, self.group)

    # -- the fence ------------------------------------------------------------------------------
    def holds(self, d: Delivery) -> bool:
        # per event: two attribute reads and a clock read (d is one of our `Item`s)
        return (
            time.monotonic() < self.lease.until
            and not d.held.lost  # type: ignore[attr-defined]
            and not self.letting_go
        )

    async def wait(self, d: Delivery) -> bool:
        while not self.lease.ok():
            if not self._current(d):
                return False
            await self.lease.changed()
        return self._current(d)

    def _current(self, d: Delivery) -> bool:
        return not self.letting_go and not d.held.lost  # type: ignore[attr-defined]

    def fenced_off(self, d: Delivery) -> None:
        """Redis refused a fenced write for `d` (``fenced_hash.lua``): the lock of its shard
        moved on. Forget the shard now if it is still held under `d`'s acquisition, so that
        nothing more of it is read or started; the next lock round sees who holds it."""
        if self.table.current(d.shard, d.generation):
            log.warning(
                "consumer %s drops shard %d: Redis refused a fenced write, its lock moved on",
                self.consumer_id,
                d.shard,
            )
            self.table.forget([d.shard])
            self.wake()

    def expired(self) -> None:
        """The heartbeat found the liveness expired: nothing held is ours any more."""
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
        self.wake()

    def let_go(self) -> None:
        """Start nothing more: the fence holds for none of the entries (an at-least-once
        consumer's stop: what is queued stays pending for the next owner); `wake` tells."""
        self.letting_go = True

    def wake(self) -> None:
        """Wake what waits for the lease or for a shard to read: what is held changed."""
        self.lease.wake()
        self.table.wake()

    # -- the lock round -------------------------------------------------------------------------
    def lock_due(self) -> bool:
        """Whether this round starts with a lock round: `lock_interval_ms` after the last one,
        or at once when no shard is held or the lease ran out. Between lock rounds the held
        shards are read under the lease that heartbeats keep (`lease`); a consumer reading a
        trickle of events would otherwise run ``lock_shards.lua`` on the hashtag's node for
        every few events."""
        now = time.monotonic()
        if now >= self._next_lock or not self.table.held or not self.lease.ok():
            return True
        # owed shards: a quarter interval after the last (the holders release at their rounds)
        interval_s = self.settings.lock_interval_ms / 1000
        return self._owed(now) and now >= self._next_lock - interval_s * (1 - 1 / OWED_ROUNDS)

    def _owed(self, now: float) -> bool:
        """Holding less than its share, within `owed_until` (a share owed by a dead member stays
        owed until its TTL: not worth 4 rounds an interval for that long)."""
        return self.share > len(self.table.held) and now < self.owed_until

    async def lock_round(self, claimer: Claimer) -> None:
        """Acquire, apply the grants, catch up and recover newly held shards (through
        `claimer`), mark surplus and release the drained surplus at once (not after the next
        read, which may block for `block_max_ms`): a joiner takes it at its next lock round."""
        n = self.topic.shards
        self._next_lock = time.monotonic() + self.settings.lock_interval_ms / 1000
        # under a valid lease, a round at an unchanged epoch only checks the held locks (no
        # script, no liveness refresh: the heartbeat renews the lease); without one, the script
        lock = self.locks.poll if self.lease.ok() else self.locks.acquire
        with refused("EVALSHA lock_shards", self.topic.name):
            grants = await lock([(self._rotation + i) % n for i in range(n)])
        self._rotation = (self._rotation + 1) % n
        if grants.refreshed:
            self.lease.renew(grants.sent_at)
        lost, new = self.table.apply(grants.grants)
        if new or not self.joined.is_set():  # joined, or shards are coming: more may follow
            self.owed_until = time.monotonic() + self.settings.block_max_ms / 1000
        self.joined.set()
        self._m_shards.round(*grants.taken(new), len(lost), len(self.table.held))
        if grants.unusable or self._unusable:
            self._unusable = report_unusable(
                self.consumer_id, self.topic.name, grants.unusable, self._unusable, self.on_refused
            )
        for s in lost:
            log.warning("consumer %s lost shard %d to another consumer", self.consumer_id, s)
        if new and self.sub.options.on_failure == "park":
            try:  # parked by a previous owner? Not known: the new shards are not read
                with refused("HGETALL", self.keys.parked(self.topic.name, self.group)):
                    await claimer.load_parked()
            except BaseException:
                self.table.forget(new)
                raise
        # Whatever state the lock was in, a new owner claims the shard's pending entries first:
        # a free lock is not a clean shard, since a consumer that left gracefully leaves the
        # entries it had read but not started pending. (NOACK reads leave no pending entries,
        # but a NOACK group behind the archive is caught up all the same.)
        recover = new
        if recover and claimer.catch_up is not None:
            recover = await self._catch_up(claimer.catch_up, recover)
        if recover and not self.noack:
            await self._recover(recover, claimer)
        self.table.mark_surplus(grants.share)
        self.share = grants.share
        drained = [h.shard for h in self.table.held.values() if h.draining and not h.in_flight]
        if drained:
            await self.release(drained)

    async def _recover(self, shards: list[int], claimer: Claimer) -> None:
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
                await claimer.claim(
                    held, lambda h: self.table.held.get(h.shard) is h and self.lease.ok()
                )
        except BaseException:
            self.table.forget(shards)
            raise

    def shard_room(self, count: int) -> int:
        """The per-shard read-ahead bound for reads of `count`: a shard is read while at most
        one read's worth of its entries is in flight (one handled, the next read meanwhile), so
        one hot shard cannot take all of `max_in_flight`, and what a draining shard must finish,
        or a crash leaves to XAUTOCLAIM, does not grow with it (docs/operations.md). NOACK reads
        lose what they read ahead at a stop or a lost lease: a shard of theirs is read only once
        its last read is finished (0) (docs/semantics.md, at-most-once)."""
        return 0 if self.noack else count

    def poll_ms(self, block_ms: int) -> int:
        """How long a round waits before the next, in a read's BLOCK or with no shard to read:
        the read loop's BLOCK (doubling while rounds get nothing), but at most a quarter
        `lock_interval_ms` (`OWED_ROUNDS`) while `_owed`: a joiner takes its shards at its round
        after the holders' (it took them up to `block_max_ms` late). A standby (share 0) backs
        off with the BLOCK; the window bounds a share owed by members slow to release (one
        polling every `lock_interval_ms` for ever ran 10 lock rounds a second)."""
        if self._owed(time.monotonic()):
            interval_ms = self.settings.lock_interval_ms
            return min(block_ms, max(1, interval_ms // OWED_ROUNDS) if interval_ms else block_ms)
        return block_ms

    # -- trims and catch-up ---------------------------------------------------------------------
    async def check_trims(self, claimer: Claimer) -> None:
        """Check the held shards that are due for entries trimmed before the group read them
        (`trims`), before reading past them; with an archive, a shard found trimmed ahead, or
        one whose trims Redis cannot count while its group's position lies before the stream's
        first entry (`TrimCheck.uncounted`), is marked `behind`: not read again until its
        entries in flight (all older than the gap) are finished and the catch-up hook has
        handled the gap, one after the other, as the resources' order needs
        (`_catch_up_behind`)."""
        due = self.trims.due(list(self.table.held.values()), time.monotonic())
        if due:
            await self._check_due(due, archived=claimer.catch_up is not None)
        if claimer.catch_up is not None:
            await self._catch_up_behind(claimer.catch_up)

    async def _check_due(self, due: list[HeldShard], *, archived: bool) -> None:
        with refused("XINFO / XADD (trim check)", ",".join(h.stream for h in due)):
            checked = await self.trims.check(due)
        if archived:  # the hook tells, from the archive, what was trimmed
            for s in [t.shard for t in checked.found if t.ahead] + checked.uncounted:
                if (held := self.table.held.get(s)) is not None:
                    held.behind = True
        if self.topic.retention == "acked":
            await self._trim_to_acked(due, archived=archived)

    async def _trim_to_acked(self, due: list[HeldShard], *, archived: bool) -> None:
        """Trim the `due` shards to what every group acked (``retention="acked"``). A refused
        trim (NOPERM without the trimming role, OOM...) is logged at ERROR and counted, and the
        round goes on: the reads do not depend on it, and failing the round for it kept every
        shard unread while the error lasted."""
        streams = {h.shard: h.stream for h in due}
        try:
            with refused("XTRIM (retention=acked)", ",".join(streams.values())):
                await trim_held_to_acked(
                    self.redis,
                    self.keys.checkpoints(self.topic.name),
                    streams,
                    archived=archived,  # the bus has an archive
                    exact=self.settings.retention_trim_exact,
                    offloader_locks=self.keys.locks(self.topic.name, OFFLOADER_GROUP),
                )
        except RedisCommandRefused as exc:
            self.on_refused(exc.command)
            log.error("consumer %s: %s; the shards are read on, untrimmed", self.consumer_id, exc)

    async def _catch_up_behind(self, hook: CatchUpHook) -> None:
        """Catch up the shards marked `behind` whose entries in flight are all finished (the
        hook handles their PEL too: nothing of it may still be queued or running), whatever
        their last check (`CatchUpSchedule.run`); they are read again after."""
        ready = [h.shard for h in self.table.held.values() if h.behind and not h.in_flight]
        if not ready:
            return
        for s in await self._catch_up(hook, ready):
            if (held := self.table.held.get(s)) is not None:  # (not dropped meanwhile)
                held.behind = False

    async def _catch_up(self, hook: CatchUpHook, shards: list[int]) -> list[int]:
        """Let the catch-up `hook` handle what the group missed in newly locked `shards` before
        they are read (`CatchUpSchedule.run`); returns the shards still held."""
        return await self.catching_up.run(hook, shards, self.table, self.release)

    # -- letting go -----------------------------------------------------------------------------
    async def release(self, shards: list[int]) -> None:
        """Release the locks of `shards` and forget them."""
        with refused("EVALSHA unlock_shards", self.topic.name):
            await self.locks.release(shards)
        self.table.forget(shards)

    async def leave(self) -> None:
        """Release every lock and leave the group's live members (at the end of the consumer):
        another consumer takes the shards over at its next round rather than after the liveness
        TTL. A lost connection is logged at ERROR: they free up after the TTL then."""
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
