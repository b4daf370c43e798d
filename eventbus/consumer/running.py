"""Running a bus's consumers: one `Consumer` per subscription (with the durable tier's catch-up
when the bus has an archive), all supervised in one task group until `stop` is set or, with
`handle_signals`, SIGTERM/SIGINT arrives. `EventBus.run` is the entry point."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus

from eventbus.client.loops import stop_on_signal, young_gc_threshold
from eventbus.config import Settings
from eventbus.consumer import Consumer, Subscription
from eventbus.consumer.broadcast import BroadcastConsumer
from eventbus.consumer.catching_up import CatchUpHook
from eventbus.consumer.delivery import Tally
from eventbus.consumer.handling import Handling
from eventbus.locking.locks import new_member_id
from eventbus.locking.member import AsyncRedis, Member
from eventbus.locking.scripts import Scripts
from eventbus.profiles import EVENTBUS, WireProfile
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig, TopicRegistry

log = logging.getLogger("eventbus")

MANY_CONSUMERS = 50
"""Past this many subscriptions in one process, `run_consumers` warns: each group's idle lock
rounds and reads cost CPU, and a process with hundreds of them idles at most of a core."""


class Lease(Protocol):
    def ok(self) -> bool: ...


class Running(Protocol):
    """What the bus, its health checks and `eventbus.testing` see of a running consumer, group
    (`Consumer`) or broadcast (`BroadcastConsumer`)."""

    consumer_id: str
    topic: TopicConfig
    group: str
    settings: Settings
    tally: Tally
    started: anyio.Event
    """Set once it reads: an event published from then on reaches it."""

    @property
    def lease(self) -> Lease:
        """What a readiness check asks (`eventbus.ops.health`): a group's lease, valid while it
        holds its locks; a broadcast's open ownership, ok once it reads."""
        ...

    @property
    def in_flight(self) -> int: ...

    async def run(self, stop: anyio.Event) -> None: ...

    def mark_reads(self, marks: Callable[[str], ReadMarks]) -> None:
        """Add to `marks(stream)`, for each stream it reads, how a reader of that stream tells
        it has read the stream to its end: its group (whose delivery and pending entries Redis
        knows) or its position (kept in process). `eventbus.testing.TestBus.drain` asks every
        consumer alike, whatever its kind."""


class ReadMarks(Protocol):
    """What tells that one stream was read to its end (`eventbus.testing.drain.Watch`)."""

    groups: list[str]
    """Groups that must have been delivered its last entry, with none pending."""
    positions: list[tuple[str, Callable[[], Any]]]
    """(reader name, its last entry ID read or None) of readers without a group."""


def make_consumers(
    subscriptions: Sequence[Subscription],
    redis: AsyncRedis,
    keys: Keys,
    settings: Settings,
    registry: TopicRegistry,
    *,
    archive: Any | None = None,
    profile: WireProfile = EVENTBUS,
) -> list[Running]:
    """One `Consumer` per subscription (a `BroadcastConsumer` for a broadcast one), sharing the
    Redis client `redis`, its scripts and the topic `registry`. With `archive` (the durable
    tier's segment store), each consumer catches a lagging group up from it
    (`eventbus.consumer.catchup`). `profile`: the bus's wire profile, every member's."""
    scripts = Scripts.register(redis)
    catch_up = None
    if archive is not None:
        from eventbus.consumer.catchup import shard_hook  # imports the tier's extras

        def catch_up(handling: Handling) -> CatchUpHook:
            return shard_hook(archive, handling)

    consumers: list[Running] = []
    for sub in subscriptions:
        member = Member(redis, keys, settings, sub.topic.name, sub.group, new_member_id(), profile)
        if sub.options.broadcast:
            consumers.append(BroadcastConsumer(member, registry, sub))
        else:
            consumers.append(Consumer(member, registry, sub, scripts, catch_up=catch_up))
    return consumers


async def run_consumers(
    consumers: Sequence[Running],
    stop: anyio.Event,
    *,
    handle_signals: bool,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `consumers` until `stop` is set (set by SIGTERM/SIGINT too, with `handle_signals`);
    returns when every consumer has shut down. Reports `task_status.started()` (anyio's
    ``await tg.start(...)``) once every consumer has started (`Running.started`: its groups
    exist, a broadcast consumer took its start positions): an event published from then on
    reaches every subscriber, ``start="now"`` groups included."""
    if len(consumers) > MANY_CONSUMERS:
        log.warning(
            "this process runs %d subscriptions, each its own consumer (lock rounds, heartbeats, "
            "blocking reads): measured here, 100 idle ones of 16 shards took 5-8 %% of a core "
            "idle and 0.1-0.2 s to hand one event to all, each group making its own round trips "
            "on the one event loop (docs/operations.md, many groups); "
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
                    await consumer.started.wait()
                task_status.started()
            outer.cancel_scope.cancel()
