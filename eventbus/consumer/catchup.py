"""Catch-up through the consumer's handling path: typed events, the subscription's retry
policy, de-duplication, dead letters, parking and control entries, for entries the durable tier
reads back (`eventbus.tier.catchup` runs the shards, their locks and segments).

`shard_hook` is the live consumer's hook (a shard it has just locked, before reading it);
`catch_up` runs a group's catch-up on its own, before its consumers start.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.consumer.batching import BatchHandlerCall, BatchRunner, is_batch
from eventbus.consumer.delivery import Outcome, wait_retry
from eventbus.consumer.handling import Handling
from eventbus.consumer.shards import HeldShard, Item
from eventbus.consumer.watchdog import Slot
from eventbus.errors import ConfigError
from eventbus.locking.locks import Fenced
from eventbus.protocol.ids import parse_id
from eventbus.tier.archived import EntryBatch
from eventbus.tier.catchup import CatchUp, CatchUpStats, _member
from eventbus.tier.catchup_shard import MAX_ROUNDS, ShardCatchUp
from eventbus.tier.replay import ArchivedEntry
from eventbus.tier.store import Store

log = logging.getLogger("eventbus.tier")

_CHUNK = 500
"""Rows of a segment's batch made items and handled at a time by a per-event subscription's
catch-up (`TypedCatchUp.rows`; a batch subscription's: its ``max_batch``)."""


async def catch_up(
    bus: Any,
    store: Store,
    topic: str,
    group: str,
    *,
    only: Sequence[int] | None = None,
    lock_timeout_s: float = 30.0,
    max_rounds: int = MAX_ROUNDS,
) -> CatchUpStats:
    """Catch up the group's subscriber registered on `bus` (an `EventBus`) with
    ``@bus.subscriber(topic, group=group)`` through the live consumer's handling path
    (`eventbus.consumer.handling`): typed events and a `Context`, the subscriber's retry policy,
    de-duplication, dead letters, parking and the operator's control entries, and no handler
    started without a confirmed lock. Run it before starting the group's consumers (it needs
    their shard locks). `lock_timeout_s` (seconds) and `max_rounds` as in `CatchUp.run`.
    Raises `ConfigError` if no such subscriber is registered, `LockUnavailable`,
    `CatchUpOutpaced`.
    """
    sub = next((s for s in bus.subscriptions if s.topic.name == topic and s.group == group), None)
    if sub is None:
        raise ConfigError(f"no subscriber registered for topic {topic!r} group {group!r}")
    settings: Settings = bus.settings
    shards = int((await bus.registry.stored()).get(topic, sub.topic.shards))
    member = _member(bus.redis, settings, topic, group)
    runner = CatchUp(member, store, shards=shards)
    handling = Handling(member, sub, retry.forever(settings.retry_base_s, settings.retry_max_s))
    async with handling.watchdog.watching():  # the subscription's handler_timeout_s
        typed = TypedCatchUp(handling)
        return await runner.run(
            typed, shards=only, lock_timeout_s=lock_timeout_s, max_rounds=max_rounds
        )


def shard_hook(store: Store, handling: Handling) -> Callable[[int, int], Awaitable[bool]]:
    """The live consumer's catch-up hook (`Pipeline.catch_up`, made by `Consumer`'s `catch_up`):
    ``await hook(shard, token)`` catches one shard the consumer has just locked up to Redis's first
    entry, under that same lock (re-taken with the consumer's ID, so the token must stay `token`),
    through the consumer's own `handling` (same parked set, counters and policy), before the
    consumer reads the shard: pass after pass over the archive while Redis lacks entries after the
    group's position (the offloader may archive and trim more meanwhile), at most `MAX_ROUNDS`.
    Returns whether the shard was behind. Raises `Fenced` when the lock was lost meanwhile (the new
    owner catches up; this consumer must let the shard go) or the consumer is stopping (the entry in
    hand is let go, as on the consumer's own path), `CatchUpOutpaced` past `MAX_ROUNDS`."""
    sub, redis, consumer_id = handling.sub, handling.redis, handling.consumer_id
    runner = CatchUp(handling.member, store, shards=sub.topic.shards, revive=False)
    typed = TypedCatchUp(handling)

    async def hook(shard: int, token: int) -> bool:
        stats = CatchUpStats()
        sc = ShardCatchUp(runner, shard, token, typed, stats, stopping=handling.halting)
        behind = False
        try:
            delivered = await sc.last_delivered()
            if delivered is None:
                return False
            head = await sc.head()
            summary = await redis.xpending(sc.stream, sub.group)
            lowest = summary.get("min") if summary.get("pending") else None
            trimmed_pending = lowest is not None and parse_id(lowest) < head
            if not trimmed_pending and head <= delivered.next():
                # nothing the group needs is missing from Redis: the consumer's own recovery
                # (with its park, control-entry and retry handling) takes it from here
                return False
            if trimmed_pending:
                await sc.pending()
            while await sc.behind(delivered):  # one pass missed what was trimmed during it
                if sc.rounds >= sc.max_rounds:
                    raise await sc.outpaced(delivered)
                sc.rounds += 1
                if not await sc.after(delivered):
                    break  # lost before archiving (logged): the consumer goes on from Redis
                behind = True
                delivered = sc.delivered or delivered
        except Fenced:
            if sc.stopped():
                log.info("catch-up of shard %d by %s stopped with the consumer", shard, consumer_id)
            else:
                log.warning("catch-up of shard %d by %s lost its lock", shard, consumer_id)
            raise  # the shard is not this consumer's any more: it must not recover or read it
        if behind or stats.pending_acked:
            log.info(
                "consumer %s caught shard %d of %s/%s up: %d entries from segments, %d from Redis",
                consumer_id,
                shard,
                sub.topic.name,
                sub.group,
                stats.from_segments,
                stats.from_redis,
            )
        return behind

    return hook


class TypedCatchUp:
    """Catch-up through a subscription's `Handling`, by batches (`batch`: a segment's entries,
    or a page of Redis's): decoded and validated as a read's are (`Handling.prepare`, once per
    batch); a batch subscription's handler is called on up to `max_batch` of them at once by
    the live consumer's own `BatchRunner` (its retries, splits, per-event path and fencing);
    other subscriptions step each entry until it is finished (handled, skipped, dead-lettered,
    control executed), waiting out retry delays in place. A lost lock or a stopping consumer
    (`Outcome.LET_GO`) lets the rest of the batch go: the shard stops with `Fenced`."""

    def __init__(self, handling: Handling) -> None:
        self.handling = handling
        self._parked_for: weakref.WeakSet[ShardCatchUp] = weakref.WeakSet()  # shards run at once
        self._held: weakref.WeakKeyDictionary[ShardCatchUp, HeldShard] = weakref.WeakKeyDictionary()

    async def __call__(self, entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        if await self.batch([entry], sc) < 1:
            raise Fenced

    async def batch(self, entries: Sequence[ArchivedEntry], sc: ShardCatchUp) -> int:
        """Handle `entries` (consecutive entries of `sc`'s shard) in order; returns how many were
        finished before the rest were let go (`BatchHandle.batch`)."""
        held = await self._held_shard(sc)
        items = [
            Item(
                e.shard,
                sc.token,
                str(e.entry_id).encode(),
                e.fields(),
                0,
                0,
                e.segment or None,
                held=held,
            )
            for e in entries
        ]
        return await self._items(items, sc)

    async def rows(self, batch: EntryBatch, sc: ShardCatchUp) -> int:
        """`batch` for the rows of a segment as read (`RowsHandle.rows`): the items made from
        its columns (`EntryBatch.stream_entries`), without `ArchivedEntry`s, a handler's batch
        (`_CHUNK` for a per-event handler) at a time: a segment's batch is 8,192 rows, and
        holding all their decoded events until the last is handled made decoding and
        validating them ~1.7 x slower than the live consumer's (stress/results/
        catchup-profile-s9.md)."""
        held = await self._held_shard(sc)
        ids, fields = batch.stream_entries()
        shard, token, segment = sc.shard, sc.token, batch.segment
        call = self.handling.sub.call
        size = call.max_batch if is_batch(call) else _CHUNK
        for start in range(0, len(ids), size):
            stop = start + size
            items = [
                Item(shard, token, i, f, 0, 0, segment, held=held)
                for i, f in zip(ids[start:stop], fields[start:stop], strict=True)
            ]
            done = await self._items(items, sc)
            if done < len(items):
                return start + done
        return len(ids)

    async def _held_shard(self, sc: ShardCatchUp) -> HeldShard:
        """The `HeldShard` the items of `sc` are read under; the first time, the subscription's
        parked resources loaded when it parks."""
        handling = self.handling
        if sc not in self._parked_for and handling.sub.options.on_failure == "park":
            # as a new lock owner does: the shard's resources may have been parked before
            self._parked_for.add(sc)
            await handling.failures.load_parked()
        held = self._held.get(sc)
        if held is None:
            held = self._held[sc] = HeldShard(sc.shard, sc.stream, sc.token, 0)
        return held

    async def _items(self, items: list[Item], sc: ShardCatchUp) -> int:
        handling = self.handling
        try:
            if is_batch(handling.sub.call):
                return await self._batches(items, sc)
            return await self._each(items, sc)
        finally:
            handling.flush_metrics()  # catch-up's metrics: once per batch

    async def _each(self, items: list[Item], sc: ShardCatchUp) -> int:
        handling = self.handling
        handling.prepare(items)
        for done, d in enumerate(items):
            while True:
                step = await handling.step(d, sc)
                if step is Outcome.ACK:
                    break
                if step is Outcome.LET_GO:
                    return done
                await wait_retry(step, handling.halting)
        return len(items)

    async def _batches(self, items: list[Item], sc: ShardCatchUp) -> int:
        """The live consumer's `BatchRunner` on `items`, `max_batch` at a time, with `sc` as
        its fence; what it acks is finished here (the caller moves the group's position),
        what it lets go ends the batch."""
        handling = self.handling
        finished = _Finished()

        async def process(item: Item, slot: Slot) -> float | None:
            step = await handling.step(item, sc, slot)
            if step is Outcome.ACK:
                finished.ack(item)
            elif step is Outcome.LET_GO:
                finished.finish(item)
            else:
                return step
            return None

        runner = BatchRunner(handling, sc, process, finished)  # type: ignore[arg-type]
        runner.stopping = handling.halting  # retry waits end when the consumer stops reading
        size = cast(BatchHandlerCall, handling.sub.call).max_batch
        slot = handling.watchdog.slot()
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            await runner.run(chunk, slot)
            if finished.let_go:
                return start + finished.prefix(chunk)
            finished.acked.clear()
        return len(items)


class _Finished:
    """Stands in for the consumer's `Acks` under a catch-up's `BatchRunner`: which entries were
    finished by an ack (handled, dead-lettered, skipped), and whether any was let go."""

    def __init__(self) -> None:
        self.acked: set[int] = set()  # ids of the items acked
        self.let_go = False

    def ack(self, item: Item) -> None:
        self.acked.add(id(item))

    def ack_many(self, items: list[Item]) -> None:
        self.acked.update(map(id, items))

    def finish(self, item: Item) -> None:
        self.let_go = True

    def prefix(self, items: list[Item]) -> int:
        """How many of `items`, from the first, were acked (the rest: let go, or after one)."""
        n = 0
        for item in items:
            if id(item) not in self.acked:
                break
            n += 1
        return n
