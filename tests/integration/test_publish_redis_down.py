"""`publish()` while Redis is down or restarting, on a private redis-server (AOF on, restarted on
the same port).

- The topic's dictionary refresh (an HGET every `dictionaries.REFRESH_S`) is best effort: a
  connection error keeps the cached dictionary, and the caller sees `PublishError`, never a raw
  redis-py error; once Redis is back the first publish succeeds, with that dictionary.
- `publish_timeout_s` is a deadline: the flusher does not sleep a whole backoff delay past it.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import anyio
import pytest
from redis.backoff import ConstantBackoff
from support import Tick

from eventbus import EventBus, PublishError, Settings
from eventbus.cli.topic import sample_bodies
from eventbus.protocol import dictionaries
from eventbus.protocol.codec import F_DATA
from eventbus.protocol.dictionaries import Dictionaries, dictionary_id
from eventbus.protocol.sharding import shard_of
from localredis.server import RedisServer

pytestmark = pytest.mark.anyio
TOPIC = "orders"


async def _publish(bus: EventBus, seq: int) -> str:
    rid = f"r{seq % 7}"
    tick = Tick(resource=rid, seq=seq, pad=f"pad {seq % 13} " * 4)
    return await bus.publish(TOPIC, tick, resource_id=rid)


@pytest.mark.parametrize("entered", [False, True], ids=["alone", "flusher"])
async def test_dictionary_refresh_while_redis_restarts_keeps_the_cached_one(
    monkeypatch: pytest.MonkeyPatch, entered: bool
) -> None:
    monkeypatch.setattr(dictionaries, "REFRESH_S", 0.0)  # every publish refreshes
    with RedisServer(appendonly="always") as server:
        bus = EventBus(Settings(redis_url=server.url, shards=2, publish_timeout_s=0.5))
        async with AsyncExitStack() as stack:
            if entered:
                await stack.enter_async_context(bus)
            for seq in range(300):
                await _publish(bus, seq)
            d = Dictionaries(bus.redis, bus.keys)
            bodies = await sample_bodies(bus, d, TOPIC, 300, bus.settings)
            dict_id = await d.train(TOPIC, bodies, size=2048)
            await _publish(bus, 300)
            assert bus.publisher.dictionaries.cached_current(TOPIC) == dict_id

            server.stop()
            with pytest.raises(PublishError, match=r"not confirmed within 0\.5 s"):
                await _publish(bus, 301)
            assert bus.publisher.dictionaries.cached_current(TOPIC) == dict_id

            await anyio.to_thread.run_sync(server.start)  # same port, AOF reloaded
            entry_id = await _publish(bus, 302)  # the first call after the restart
            stream = bus.keys.stream(TOPIC, shard_of("r1", bus.topic(TOPIC).shards))
            ((_, fields),) = await bus.redis.xrange(stream, entry_id, entry_id)
            assert dictionary_id(fields[F_DATA]) == dict_id
        await bus.aclose()


async def test_publish_deadline_is_not_overshot_by_the_retry_backoff() -> None:
    """The flusher's backoff after a connection error is 2 s here; the deadline is 0.5 s."""
    timeout = 0.5
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, shards=2, publish_timeout_s=timeout))
        async with bus:
            await _publish(bus, 0)
            bus.publisher.sender.backoff = ConstantBackoff(2.0)
            server.stop()
            started = time.monotonic()
            with pytest.raises(PublishError, match=r"not confirmed within 0\.5 s"):
                await _publish(bus, 1)
            elapsed = time.monotonic() - started
            # a 2 s sleep would end at 2 s; a loaded machine adds tenths, not seconds
            assert timeout <= elapsed < timeout + 1.0, elapsed
        await bus.aclose()
