"""`EventBus` lifecycle: connecting, hooks, and their order around the consumers."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import redis.asyncio
from support import Tick, running, wait_until

from eventbus import EventBus, RedisUnavailable, Settings
from localredis.server import free_port

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]


async def test_unreachable_redis_is_refused_at_start() -> None:
    bus = EventBus(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        async with bus:
            pass
    await bus.aclose()


async def test_hooks_run_around_the_consumers(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2))
    events: list[str] = []
    members = bus.keys.members("t", "g")

    @bus.on_startup
    async def startup() -> None:
        events.append("startup")

    @bus.on_shutdown
    async def shutdown() -> None:
        # the consumers have stopped and left the group; the connection is still usable
        events.append(f"shutdown members={await bus.redis.zcard(members)}")

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        events.append(f"handled {event.seq}")

    await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")
    async with running(bus) as [run]:
        await wait_until(lambda: "handled 0" in events)
        run.stop()
        with anyio.fail_after(10):
            await run.done.wait()
    assert events == ["startup", "handled 0", "shutdown members=0"]


async def test_a_failing_startup_hook_stops_the_run(settings: SettingsFactory) -> None:
    bus = EventBus(settings())

    @bus.on_startup
    async def startup() -> None:
        raise RuntimeError("no config")

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        raise AssertionError("must not run")

    with anyio.fail_after(10), pytest.raises(RuntimeError, match="no config"):
        await bus.run()
    await bus.aclose()
