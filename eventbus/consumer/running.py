"""Running a bus's consumers: one `Consumer` per subscription (with the durable tier's catch-up
when the bus has an archive), all supervised in one task group until `stop` is set or, with
`handle_signals`, SIGTERM/SIGINT arrives. `EventBus.run` is the entry point."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from eventbus.client.loops import stop_on_signal, young_gc_threshold
from eventbus.config import Settings
from eventbus.consumer import Consumer, Subscription
from eventbus.consumer.broadcast import BroadcastConsumer
from eventbus.locking.locks import new_member_id
from eventbus.locking.member import AsyncRedis, Member
from eventbus.locking.scripts import Scripts
from eventbus.profiles import WireProfile
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicRegistry

log = logging.getLogger("eventbus")

MANY_CONSUMERS = 50
"""Past this many subscriptions in one process, `run_consumers` warns (issue 19 item 16)."""


def make_consumers(
    subscriptions: Sequence[Subscription],
    redis: AsyncRedis,
    keys: Keys,
    settings: Settings,
    registry: TopicRegistry,
    *,
    archive: Any | None = None,
    profile: WireProfile | None = None,
) -> list[Consumer | BroadcastConsumer]:
    """One `Consumer` per subscription (a `BroadcastConsumer` for a broadcast one), sharing the
    Redis client `redis`, its scripts and the topic `registry`. With `archive` (the durable
    tier's segment store), each consumer catches a lagging group up from it
    (`eventbus.consumer.catchup`). `profile`: the bus's wire profile (default eventbus's)."""
    scripts = Scripts.register(redis)
    consumers: list[Consumer | BroadcastConsumer] = []
    for sub in subscriptions:
        member = Member(redis, keys, settings, sub.topic.name, sub.group, new_member_id(), profile)
        if sub.options.broadcast:
            consumers.append(BroadcastConsumer(member, registry, sub))
            continue
        c = Consumer(member, registry, sub, scripts)
        if archive is not None:
            from eventbus.consumer.catchup import shard_hook  # imports the tier's extras

            c.catch_up = shard_hook(archive, c.handling)
        consumers.append(c)
    return consumers


async def run_consumers(
    consumers: list[Consumer | BroadcastConsumer],
    stop: anyio.Event,
    *,
    handle_signals: bool,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `consumers` until `stop` is set (set by SIGTERM/SIGINT too, with `handle_signals`);
    returns when every consumer has shut down. Reports `task_status.started()` (anyio's
    ``await tg.start(...)``) once every broadcast consumer has taken its start positions: an
    event published from then on reaches every subscriber (a group reads from its group's
    position whenever it starts)."""
    if len(consumers) > MANY_CONSUMERS:
        log.warning(
            "this process runs %d subscriptions, each its own consumer (lock rounds, heartbeats, "
            "blocking reads): measured here, 100 idle ones of 16 shards took about a quarter of "
            "a core and 0.15 s to hand one event to all (docs/operations.md, many groups); "
            "consider fewer groups per process, or processes per group of subscriptions",
            len(consumers),
        )
    threshold = max((c.settings.gc_threshold for c in consumers), default=0)
    with young_gc_threshold(threshold):
        async with anyio.create_task_group() as outer:
            if handle_signals:
                outer.start_soon(stop_on_signal, stop)
            async with anyio.create_task_group() as tg:
                for consumer in consumers:
                    tg.start_soon(consumer.run, stop)
                for consumer in consumers:
                    if isinstance(consumer, BroadcastConsumer):
                        await consumer.started.wait()
                task_status.started()
            outer.cancel_scope.cancel()
