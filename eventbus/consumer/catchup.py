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
from typing import Any

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.consumer.delivery import Delivery, Outcome, wait_retry
from eventbus.consumer.handling import Handling
from eventbus.errors import ConfigError
from eventbus.locking.locks import Fenced
from eventbus.protocol.ids import parse_id
from eventbus.tier.catchup import CatchUp, CatchUpStats, _member
from eventbus.tier.catchup_shard import MAX_ROUNDS, ShardCatchUp
from eventbus.tier.replay import ArchivedEntry
from eventbus.tier.store import Store

log = logging.getLogger("eventbus.tier")


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
    """The live consumer's catch-up hook (`Consumer.catch_up`): ``await hook(shard, token)``
    catches one shard the consumer has just locked up to Redis's first entry, under that same
    lock (re-taken with the consumer's ID, so the token must stay `token`), through the
    consumer's own `handling` (same parked set, counters and policy), before the consumer reads
    the shard: pass after pass over the archive while Redis lacks entries after the group's
    position (the offloader may archive and trim more meanwhile), at most `MAX_ROUNDS`. Returns
    whether the shard was behind. Raises `Fenced` when the lock was lost meanwhile (the new
    owner catches up; this consumer must let the shard go) or the consumer is stopping (the
    entry in hand is let go, as on the consumer's own path), `CatchUpOutpaced` past
    `MAX_ROUNDS`."""
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
    """Catch-up through a subscription's `Handling`: each entry is decoded and validated as a
    read's are (`Handling.prepare`), then stepped until it is finished (handled, skipped,
    dead-lettered, control executed), waiting out retry delays in place; a lost lock
    (`Outcome.LET_GO`) stops the shard with `Fenced`."""

    def __init__(self, handling: Handling) -> None:
        self.handling = handling
        self._parked_for: weakref.WeakSet[ShardCatchUp] = weakref.WeakSet()  # shards run at once

    async def __call__(self, entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        if sc not in self._parked_for and self.handling.sub.options.on_failure == "park":
            # as a new lock owner does: the shard's resources may have been parked before
            self._parked_for.add(sc)
            await self.handling.failures.load_parked()
        d = Delivery(
            entry.shard,
            sc.token,
            str(entry.entry_id).encode(),
            entry.fields(),
            segment=entry.segment or None,
        )
        self.handling.prepare([d])
        while True:
            step = await self.handling.step(d, sc)
            if step is Outcome.ACK:
                self.handling.flush_metrics()  # catch-up is no hot path: one event at a time
                return
            if step is Outcome.LET_GO:
                raise Fenced
            await wait_retry(step, self.handling.halting)
