"""Catch-up: a consumer group whose next entries were trimmed from Redis reads them from segments.

`eventbus.consumer.catchup.catch_up` (typed, with the bus's registered handler) and
`catch_up_group` (raw entries) run,
for each shard of a topic, under the *group's own* shard lock, taken with ``lock_shards.lua``
like a consumer (so no consumer of the group reads the shard meanwhile):

1. **Pending entries** of the group (delivered, never acked), in entry-ID order: from Redis when
   still there, from segments when trimmed. Each is handled, then ``XACK``-ed. They come first
   because they precede everything after the group's last-delivered ID (per-resource order).
2. **After the last-delivered ID** ``D``: when the stream's first entry lies after ``D`` (so
   entries after ``D`` may be missing from Redis), every archived entry after ``D`` is handled in
   entry-ID order, reading segments (several at a time), and ``XGROUP SETID`` moves ``D`` past
   them, segment by segment, on to the end of the archive (past what Redis still holds).
3. If segments hold nothing after ``D`` while Redis lacks entries after ``D``, those entries were
   lost before archiving (see the shard's gap records): logged at ERROR level and counted.
4. **Then Redis**: the entries after ``D`` that Redis holds, up to the stream's last entry,
   ``XGROUP SETID`` after each page. Should the offloader trim past ``D`` meanwhile (the page
   read may miss entries), step 2 runs again from ``D``: a new round. A shard still behind
   after ``max_rounds`` rounds (`MAX_ROUNDS`) fails the catch-up with `CatchUpOutpaced`.

Whether Redis lacks entries after ``D`` comes from the stream's accounting when the offloader's
checkpoint is at or before ``D`` (`ShardCatchUp.behind`): a first entry after ``D``'s
successor may be a gap in entry IDs (times), not in entries.

The shards run concurrently, each in its own task (`CatchUp.run`). A shard caught up keeps
following its stream (``XREAD BLOCK``, steps 2 to 4 again) until every shard is caught up, so a
shard with a long backlog does not make the others fall behind Redis's first entry again, and
the catch-up ends whatever the time one shard takes, with each group position at its stream's
last entry of a moment before.

Before every ``XACK`` / ``XGROUP SETID`` the lock is re-taken (refreshing liveness) and its
fencing token compared: a catch-up that lost its lock stops that shard at once, and fails with
`LockUnavailable` when the shard had not caught up yet. As on the live
path this is at-least-once: an entry handled right before a crash is handled again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.locking.locks import Fenced, LockClient, new_member_id
from eventbus.locking.member import AsyncRedis, Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys
from eventbus.tier.catchup_read import DECODE_THREADS
from eventbus.tier.catchup_shard import MAX_ROUNDS, Handle, ShardCatchUp
from eventbus.tier.catchup_shard import CatchUpStats as CatchUpStats  # re-exported
from eventbus.tier.checkpoint import Checkpoints
from eventbus.tier.errors import LockUnavailable
from eventbus.tier.layout import SegmentRef
from eventbus.tier.replay import ArchivedEntry
from eventbus.tier.store import Store

log = logging.getLogger("eventbus.tier")

_LOCK_POLL = retry.backoff(0.05, 1.0)
"""Waits between attempts to lock shards that live consumers hold (seconds)."""

_FOLLOW_BLOCK_MS = 250
"""How long a caught-up shard's ``XREAD BLOCK`` waits for a new entry before it checks whether
every shard is caught up (milliseconds)."""

RawHandler = Callable[[ArchivedEntry, int], Awaitable[None]]
"""``await handle(entry, fencing_token)``: process one entry; raising stops the catch-up."""


class CatchUp:
    """Catch-up of `member`'s group from `store` (a topic of `shards` shards); see the module
    docstring. The member's ID names the catch-up in the group's locks. `revive`: its lock
    confirmations may make the member live again (`LockClient.acquire`: a catch-up of its own,
    whose shards each confirm their lock before handling); a live consumer's catch-up passes
    False (`LockClient.confirm`: the consumer's own lock round alone revives it)."""

    def __init__(self, member: Member, store: Store, *, shards: int, revive: bool = True) -> None:
        self.redis, self.keys, self.settings = member.redis, member.keys, member.settings
        self.topic, self.group, self.consumer_id = member.topic, member.group, member.consumer_id
        self.store = store
        self.shards = shards
        self.locks = LockClient(member, shards=shards)
        self.revive = revive
        self.consumed: dict[int, SegmentRef] = {}  # last segment handled, per shard
        self.checkpoints = Checkpoints(self.redis, self.keys, self.topic)  # the offloader's
        self.decoding = anyio.CapacityLimiter(DECODE_THREADS)  # shared by the shards' reads

    async def lock(self, shards: Sequence[int]) -> dict[int, int]:
        """Take (or keep) the locks of `shards` that are free; returns shard -> token held."""
        grants = (await self.locks.acquire(shards)).grants
        return {s: g.token for s, g in grants.items() if s in set(shards)}

    async def run(
        self,
        handle: Handle,
        *,
        shards: Sequence[int] | None = None,
        lock_timeout_s: float = 30.0,
        max_rounds: int = MAX_ROUNDS,
    ) -> CatchUpStats:
        """Catch up `shards` (default: all), calling `handle` on each entry in entry-ID order
        per shard. Shards locked by live consumers are retried until `lock_timeout_s` seconds
        pass, then `LockUnavailable` is raised naming them. Exceptions from `handle` propagate
        unwrapped (the shard's position stays at the last entry handled before).
        A shard still behind its stream's first entry after `max_rounds` passes over the
        archive (default `MAX_ROUNDS`, 10: the offloader keeps trimming past a group that
        catches up slower than its stream grows) fails the catch-up with `CatchUpOutpaced`
        naming it and how far behind it is; ``ValueError`` if `max_rounds` < 1.

        Each shard runs in its own task under its lock: its pending entries, then the archive
        while Redis lacks entries after the group's position, then Redis up to the stream's
        last entry. A shard caught up keeps following its stream (``XREAD BLOCK``) until every
        shard is caught up, so the time one shard takes does not age the others: this returns
        once each shard has caught up, with every group position at its stream's last entry
        of a moment before, and the entries after it stay in Redis for about
        ``hot_window_s``: start the group's consumers right away.
        """
        stats = CatchUpStats()
        started = time.monotonic()
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        chosen = list(range(self.shards)) if shards is None else list(shards)
        progress = _Progress(set(chosen))
        deadline = started + lock_timeout_s
        try:
            async with anyio.create_task_group() as tg:
                progress.scope = tg.cancel_scope
                await progress.guard(
                    self._lock_all, tg, handle, progress, stats, deadline, max_rounds
                )
        finally:
            with anyio.CancelScope(shield=True):
                await self.locks.release([], leave=True)
        if progress.errors:
            raise progress.errors[0]
        stats.seconds = time.monotonic() - started
        return stats

    async def _lock_all(
        self,
        tg: anyio.abc.TaskGroup,
        handle: Handle,
        progress: _Progress,
        stats: CatchUpStats,
        deadline: float,
        max_rounds: int,
    ) -> None:
        """Start a shard task for each shard of `progress` as its lock is granted; raise
        `LockUnavailable` naming those still locked by others past `deadline`."""
        todo = sorted(progress.shards)
        waits = 0
        while todo:
            held = await self.lock(todo)
            for s, token in held.items():
                tg.start_soon(
                    progress.guard, self._shard, s, token, handle, progress, stats, max_rounds
                )
                todo.remove(s)
            if todo and not held:
                if time.monotonic() > deadline:
                    raise LockUnavailable(
                        f"catch-up of {self.topic}/{self.group}: shards {todo} stayed locked "
                        f"by live consumers past the timeout"
                    )
                waits += 1
                await anyio.sleep(_LOCK_POLL.compute(waits))

    async def _shard(
        self,
        shard: int,
        token: int,
        handle: Handle,
        progress: _Progress,
        stats: CatchUpStats,
        max_rounds: int,
    ) -> None:
        """One shard's catch-up under its lock (token `token`): pending entries, then `sync`
        (at most `max_rounds` passes over the archive) until every shard of `progress` is
        caught up, waiting for new entries in between."""
        sc = ShardCatchUp(self, shard, token, handle, stats, max_rounds=max_rounds)
        try:
            delivered = await sc.start()
            stats.shards += 1
            while delivered is not None:
                delivered = await sc.sync(delivered)
                progress.caught(shard)
                if progress.done.is_set():
                    break
                await sc.wait_entries(delivered, _FOLLOW_BLOCK_MS)
        except Fenced as exc:
            if not progress.is_caught(shard):  # its group may still be behind: not a success
                raise LockUnavailable(
                    f"catch-up of {self.topic}/{self.group}: lost the lock of shard {shard} "
                    f"before it caught up ({exc}); its group may be behind the stream's first "
                    "entry, with archived entries not handled"
                ) from exc
            log.warning("catch-up %s lost the lock of shard %d", self.consumer_id, shard)
        finally:
            progress.caught(shard)
            with anyio.CancelScope(shield=True):
                await self.locks.release([shard])


class _Progress:
    """The shards of one `CatchUp.run`: which have caught up (`done` is set once all have), and
    the first error of any task (raised unwrapped by `run`, the others cancelled)."""

    def __init__(self, shards: set[int]) -> None:
        self.shards = shards
        self.done = anyio.Event()
        self.errors: list[BaseException] = []
        self._caught: set[int] = set()
        self.scope: anyio.CancelScope | None = None  # the task group's, once it runs

    def is_caught(self, shard: int) -> bool:
        return shard in self._caught

    def caught(self, shard: int) -> None:
        self._caught.add(shard)
        if self._caught >= self.shards:
            self.done.set()

    async def guard(self, work: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Await ``work(*args)``; on an exception, record it and cancel the whole catch-up."""
        try:
            await work(*args)
        except Exception as exc:
            self.errors.append(exc)
            self.done.set()
            if self.scope is not None:
                self.scope.cancel()


async def catch_up_group(
    redis: AsyncRedis,
    store: Store,
    topic: str,
    group: str,
    handle: RawHandler,
    *,
    shards: int,
    settings: Settings | None = None,
    only: Sequence[int] | None = None,
    lock_timeout_s: float = 30.0,
    max_rounds: int = MAX_ROUNDS,
) -> CatchUpStats:
    """Catch up consumer group `group` of `topic` (`shards` shards) from `store`, calling
    ``await handle(entry, fencing_token)`` on raw `ArchivedEntry`s. See `CatchUp.run` (for
    `lock_timeout_s`, seconds, and `max_rounds`)."""
    runner = CatchUp(_member(redis, settings, topic, group), store, shards=shards)
    return await runner.run(
        _raw(handle), shards=only, lock_timeout_s=lock_timeout_s, max_rounds=max_rounds
    )


def _member(redis: AsyncRedis, settings: Settings | None, topic: str, group: str) -> Member:
    """A catch-up's own member of `group` (a fresh ``catchup-`` ID), settings from the
    environment when none are given."""
    settings = settings or Settings()  # type: ignore[call-arg,unused-ignore]  # fields from env
    keys = Keys.of(settings)
    return Member(redis, keys, settings, topic, group, f"catchup-{new_member_id()}", EVENTBUS)


def _raw(handle: RawHandler) -> Handle:
    async def each(entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        await handle(entry, sc.token)

    return each
