"""Redis unreachable at start, and lost mid-run: a clear error at start, no false success
while it is down, and nothing lost or reordered once it is back (AOF ``appendfsync always``)."""

from __future__ import annotations

import logging

import anyio
import pytest
from support import Recorder, Tick, running, wait_until
from typer.testing import CliRunner

from eventbus import EventBus, PublishError, RedisUnavailable, Settings
from eventbus.cli import app
from localredis.server import RedisServer, free_port

pytestmark = pytest.mark.anyio


async def test_unreachable_redis_at_start_is_a_clear_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    bus = EventBus(Settings(redis_url=url))

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None: ...

    with pytest.raises(RedisUnavailable, match=f"cannot reach Redis at {url}"):
        async with bus:
            pass
    with pytest.raises(RedisUnavailable):
        await bus.run()
    await bus.aclose()


def test_cli_reports_unreachable_redis_without_a_traceback() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(
        app, ["publish", "orders", "--type", "T", "--resource-id", "r", "--redis-url", url]
    )
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "cannot reach Redis" in result.output


async def test_redis_lost_mid_run_loses_nothing_and_keeps_order(tmp_path: object) -> None:
    with RedisServer(appendonly="always") as server:
        bus = EventBus(Settings(redis_url=server.url, shards=4, publish_timeout_s=0.3))
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: object) -> None:
            rec.add(event, ctx)  # type: ignore[arg-type]

        acknowledged: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}

        async def publish_round(seqs: range) -> None:
            for seq in seqs:
                for rid in acknowledged:
                    await bus.publish("orders", Tick(resource=rid, seq=seq), resource_id=rid)
                    acknowledged[rid].append(seq)

        async with running(bus):
            await publish_round(range(0, 20))
            await rec.wait_for(160)

            server.stop()  # Redis is gone; the consumer keeps retrying in the background
            with pytest.raises(PublishError, match=r"not confirmed within 0\.3 s"):
                await bus.publish("orders", Tick(resource="r0", seq=-1), resource_id="r0")

            await anyio.to_thread.run_sync(server.start)  # same port, AOF reloaded
            await publish_round(range(20, 40))
            await wait_until(lambda: _all_handled(rec, acknowledged), within_s=30)

    handled = rec.by_resource()
    for rid, seqs in acknowledged.items():
        # re-deliveries collapsed: the first handling of each seq, in handling order
        first_seen = list(dict.fromkeys(handled[rid]))
        assert first_seen == seqs, rid


def _all_handled(rec: Recorder, acknowledged: dict[str, list[int]]) -> bool:
    handled = rec.by_resource()
    return all(set(seqs) <= set(handled.get(rid, ())) for rid, seqs in acknowledged.items())


async def test_redis_that_lost_its_data_gets_its_groups_back_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After FLUSHALL (a restart without persistence, a failover to an empty
    replica) a running consumer looped for ever on NOGROUP ("XAUTOCLAIM refused" at ERROR every
    30-50 ms) and never handled the next event. It recreates the groups, says once at ERROR
    that the streams and groups vanished and where it restarts, and handles what comes next."""
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, shards=4, block_max_ms=50))
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: object) -> None:
            rec.add(event, ctx)  # type: ignore[arg-type]

        with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
            async with running(bus):
                await bus.publish("orders", Tick(resource="r", seq=0), resource_id="r")
                await rec.wait_for(1)
                await bus.redis.flushall()
                for seq in range(1, 4):
                    await bus.publish("orders", Tick(resource="r", seq=seq), resource_id="r")
                await rec.wait_for(4, within_s=20)
        assert rec.by_resource() == {"r": [0, 1, 2, 3]}
        vanished = [r for r in caplog.records if "vanished" in r.getMessage()]
        assert vanished and all(r.levelno == logging.ERROR for r in vanished)
        assert len(vanished) == 1
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) <= 1, [r.getMessage() for r in refused]


async def test_a_running_bus_writes_its_topics_again_after_redis_lost_its_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After FLUSHALL the topic registry was never written again by a running bus: ``eventbus
    tail`` said "unknown topic" for a live topic, and a later publisher with another shard
    count registered its own count with no `ShardCountMismatch`. A consumer that finds its
    streams vanished writes its topic again at once; a publisher does at its next dictionary
    refresh (`REFRESH_S`, made 0 here); the later publisher is refused."""
    from eventbus import ShardCountMismatch

    with RedisServer() as server:
        url = server.url
        bus = EventBus(Settings(redis_url=url, shards=16, block_max_ms=50))
        rec = Recorder()
        bus.subscriber("orders", group="billing")(rec.add)
        publisher = EventBus(Settings(redis_url=url, shards=16))
        async with running(bus), publisher:
            await bus.publish("orders", Tick(resource="r", seq=0), resource_id="r")
            await publisher.publish("quotes", Tick(resource="q", seq=0), resource_id="q")
            await rec.wait_for(1)
            await bus.redis.flushall()
            await bus.publish("orders", Tick(resource="r", seq=1), resource_id="r")
            await rec.wait_for(2, within_s=20)

            async def registered(topic: str) -> bool:
                return await bus.redis.hget(bus.keys.topics(), topic) == b"16"

            await wait_until(lambda: registered("orders"))  # by the consumer, at once
            monkeypatch.setattr("eventbus.protocol.dictionaries.REFRESH_S", 0.0)
            monkeypatch.setattr("eventbus.publishing.topic_setup.REFRESH_S", 0.0)
            await publisher.publish("quotes", Tick(resource="q", seq=1), resource_id="q")
            assert await registered("quotes")  # by the publisher, at its refresh
            tail = await anyio.to_thread.run_sync(
                lambda: CliRunner().invoke(app, ["tail", "orders", "--redis-url", url])
            )
            assert tail.exit_code == 0 and '"seq": 1' in tail.output, tail.output
            later = EventBus(Settings(redis_url=url, shards=4))
            async with later:
                for topic in ("orders", "quotes"):
                    with pytest.raises(ShardCountMismatch):
                        await later.publish(topic, Tick(resource="x", seq=0), resource_id="x")
            await later.aclose()
        await publisher.aclose()


class _Said(logging.Handler):
    """Sets `said` at the first record of logger ``eventbus.consumer`` containing `text`."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.said = text, anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.said.set()


@pytest.mark.parametrize("broadcast", [False, True], ids=["group", "broadcast"])
async def test_a_consumer_starting_while_redis_is_down_waits_for_it(broadcast: bool) -> None:
    """Redis lost between the bus's start checks and a consumer's own start (an app starting
    while Redis restarts): the consumer's first commands (``XGROUP CREATE``, a broadcast's
    ``XINFO STREAM``) failed with ConnectionError, which ended `EventBus.run` and every other
    consumer with it. It retries with the backoff, says so at WARNING, and handles what is
    published once Redis is back."""
    with RedisServer(appendonly="always") as server:
        bus = EventBus(Settings(redis_url=server.url, shards=2, retry_max_s=0.05))
        rec = Recorder()
        kw = {"broadcast": True} if broadcast else {"group": "billing"}
        bus.subscriber("orders", **kw)(rec.add)
        said = _Said("cannot start: Redis unavailable")
        logger = logging.getLogger("eventbus.consumer")
        logger.addHandler(said)
        stop = anyio.Event()
        try:
            async with bus, anyio.create_task_group() as tg:
                await bus.registry.ensure(bus.subscriptions[0].topic)  # the run's own check
                await anyio.to_thread.run_sync(server.stop)
                tg.start_soon(lambda: bus.run(stop=stop))
                with anyio.fail_after(20):
                    await said.said.wait()
                await anyio.to_thread.run_sync(server.start)  # same port, AOF reloaded
                if broadcast:  # it reads from where the streams ended once it started
                    await bus.consumers[0].started.wait()  # type: ignore[union-attr]
                await bus.publish("orders", Tick(resource="r", seq=1), resource_id="r")
                await rec.wait_for(1)
                stop.set()
        finally:
            logger.removeHandler(said)
        await bus.aclose()
    assert rec.by_resource() == {"r": [1]}


@pytest.mark.parametrize("broadcast", [False, True], ids=["group", "broadcast"])
async def test_a_stop_while_redis_is_down_at_the_start_returns_cleanly(broadcast: bool) -> None:
    """A consumer still waiting for Redis at its start ends at the stop, without an error."""
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, shards=2, retry_max_s=0.05))
        kw = {"broadcast": True} if broadcast else {"group": "billing"}
        bus.subscriber("orders", **kw)(Recorder().add)
        said = _Said("cannot start: Redis unavailable")
        logger = logging.getLogger("eventbus.consumer")
        logger.addHandler(said)
        stop = anyio.Event()
        try:
            async with bus:
                await bus.registry.ensure(bus.subscriptions[0].topic)
                await anyio.to_thread.run_sync(server.stop)
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(lambda: bus.run(stop=stop))
                        await said.said.wait()
                        stop.set()  # bus.run returns: the task group ends without an error
                await anyio.to_thread.run_sync(server.start)
        finally:
            logger.removeHandler(said)
        await bus.aclose()
