"""The test bus's in-memory Redis and what `eventbus.testing.running` sets for it: fakeredis
whose blocking reads block, the lock scripts loaded at once, shorter waits and fewer shards."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import anyio

from eventbus.errors import ConfigError
from eventbus.locking import scripts
from eventbus.locking.member import AsyncRedis

if TYPE_CHECKING:
    from eventbus.app import EventBus


def memory_redis() -> Any:
    """A fresh fakeredis asyncio client with Lua scripting, whose blocking ``XREADGROUP`` waits
    for an entry as Redis's does (`eventbus.testing.blocking_reads`). Raises `ConfigError` saying
    what to install when the ``testing`` extra (fakeredis with lupa) is missing."""
    try:
        import fakeredis
        import lupa  # noqa: F401  # fakeredis runs the Lua scripts with it
    except ImportError as exc:
        raise ConfigError(
            f"the in-memory bus needs fakeredis with Lua ({exc.name} is missing): "
            "pip install 'eventbus[testing]'"
        ) from None

    from eventbus.testing.blocking_reads import blocking_reads_connection

    return fakeredis.FakeAsyncRedis(
        server=fakeredis.FakeServer(version=(7, 0)),
        connection_class=blocking_reads_connection(),
    )


MEMORY_SETTINGS: dict[str, Any] = {"block_max_ms": 50, "lock_interval_ms": 1000}
"""The settings `running` gives a bus on its in-memory Redis (the bus's own are restored after).
Blocking reads end within 50 ms (and at the stop at once: `unblock_reads_at_stop`). One lock
round a second rather than ten: each consumer is alone in its group on a server of its own, so
a round after the first one only confirms its locks (each costs ~3 ms of Lua in fakeredis), and
another instance run on the same server still gets its share within a second."""

MEMORY_SHARDS = 2
"""The shard count `running` gives, in memory (a fresh server, or a fakeredis client passed as
`redis`), to the topics declared without one and to the settings' default, unless the bus's
settings set ``shards`` (``EVENTBUS_SHARDS``). Each shard is a
stream the real consumer path starts on (a group, a PEL recovery and a trim check per shard and
subscriber): 16 shards made a service's test ~2 x slower than 2. A resource's events keep their
order on any count; two shards keep resources on different streams, so a test cannot lean on one
order across resources that production would not keep either."""

LOCK_SCRIPTS = [
    f"{p}{n}" for p in ("", "verse_") for n in ("lock_shards", "unlock_shards", "heartbeat")
]
"""The scripts every consumer runs (eventbus's and the Verse profile's: `Scripts.register`)."""


async def load_lock_scripts(redis: AsyncRedis) -> None:
    """``SCRIPT LOAD`` the `LOCK_SCRIPTS` into a fresh server, in one round trip: else each
    consumer's first call of each one is answered NOSCRIPT, and loads it, and calls it again
    (30 more round trips for 5 subscribers)."""
    pipe = redis.pipeline(transaction=False)
    for name in LOCK_SCRIPTS:
        pipe.script_load(scripts.source(name))
    await pipe.execute()


UNBLOCK_EVERY_S = 0.01
"""How often `unblock_reads_at_stop` looks again for reads blocked since its last look."""


async def unblock_reads_at_stop(redis: AsyncRedis, stop: anyio.Event, done: anyio.Event) -> None:
    """Once `stop` is set, end every blocking read on `redis` (``CLIENT UNBLOCK ... TIMEOUT``:
    the read returns empty, as when its BLOCK runs out), again every `UNBLOCK_EVERY_S` seconds
    until `done` is set, so that the consumers see the stop at once rather than after their
    BLOCK. Only for a server the test bus owns (in memory): on a shared server it would end
    other clients' reads too."""
    await stop.wait()
    while not done.is_set():
        for client in await redis.client_list():
            await redis.client_unblock(int(client["id"]))
        with anyio.move_on_after(UNBLOCK_EVERY_S):
            await done.wait()


def in_memory(redis: Any) -> bool:
    """Whether `redis` is an in-memory server's client (fakeredis: `memory_redis`)."""
    return type(redis).__module__.partition(".")[0] == "fakeredis"


def use_memory_shards(bus: EventBus) -> None:
    """`MEMORY_SHARDS` for `bus`'s settings and its topics declared without a shard count,
    those of its subscriptions included."""
    bus.settings = bus.settings.model_copy(update={"shards": MEMORY_SHARDS})
    for name, config in bus._topics.items():
        if config.shards_from_settings:
            bus._topics[name] = dataclasses.replace(config, shards=MEMORY_SHARDS)
    for sub in bus.subscriptions:  # (`running` puts back the configs they had)
        sub.topic = bus._topics.get(sub.topic.name, sub.topic)
