"""Regression test of a library bug found by the chaos harness on a Redis Cluster (`stress/chaos.py
all --cluster`, short run, a restart of a primary long enough for the others to mark it failed):
a ``-CLUSTERDOWN`` reply to the consumer's blocking read (``eventbus/consumer/cluster_reads.py``,
``BlockingReads._block``) is re-raised inside the read's task group, so it leaves the read loop as
an ``ExceptionGroup`` that ``read_loop``'s ``except ResponseError`` (the back-off path of refused
commands) does not catch: the consumer process dies instead of backing off until the cluster is
up again (docs/operations.md: a consumer that gets an error reply does not stop).

Deterministic: a 3-primary cluster; a consumer idle in long blocking reads (3 s) on the two
primaries that hold its keys; the third primary SIGKILLed. Once the others mark it failed
(``cluster_state:fail``) they unblock every blocked read with ``-CLUSTERDOWN`` (Redis checks
blocked clients every 100 ms, ``clusterRedirectBlockedClientIfNeeded``). On HEAD 16ef17e the
consumer died in 4 of 4 runs (``ExceptionGroup(ClusterDownError(...))`` out of ``bus.run``). Fix: in
``_block``'s ``one``, a ``ResponseError`` other than ``UNBLOCKED`` is appended to ``errors``
instead of re-raised, so ``_block`` raises it ungrouped after the task group (``_failed`` turns
it into a lost reply when other reads of the round delivered entries) and the read loop backs
off as for any refused command (29639ed; stress/FINDINGS.md 9).
"""

from __future__ import annotations

import anyio
import pytest
import redis
from support import Tick, wait_until

from eventbus import Context, EventBus, Settings
from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.anyio


def _state(port: int) -> bytes:
    try:
        with redis.Redis(port=port, socket_timeout=1) as r:
            return bytes(r.execute_command("CLUSTER", "INFO"))
    except redis.RedisError:
        return b""


async def test_consumer_backs_off_while_the_cluster_is_down() -> None:
    with ReplicatedCluster(3, 0, node_timeout_ms=500) as cluster:
        settings = Settings(
            redis_url=cluster.url, cluster=True, shards=2, block_min_ms=3000, block_max_ms=3000,
            liveness_ttl_s=30, retry_base_s=0.02, retry_max_s=0.2, publish_timeout_s=30,
        )  # fmt: skip
        publisher, consumer = EventBus(settings), EventBus(settings)
        seen: list[int] = []

        @consumer.subscriber("ticks", group="g")
        async def handle(event: Tick, ctx: Context) -> None:
            seen.append(event.seq)

        errors: list[BaseException] = []
        stop = anyio.Event()

        async def run() -> None:
            try:
                await consumer.run(stop=stop)
            except BaseException as exc:  # the bug: the consumer stops
                errors.append(exc)

        async with publisher, anyio.create_task_group() as tg:
            tg.start_soon(run)
            await publisher.publish("ticks", Tick(resource="r", seq=1), resource_id="r")
            await wait_until(lambda: seen == [1], within_s=30)  # idle in its blocking reads now
            # the primary with none of our keys: the reads stay blocked on the other two
            keys = [consumer.keys.topics(), *(consumer.keys.stream("ticks", s) for s in (0, 1))]
            ours = {cluster.primary_of(k) for k in keys}
            victim = next(p for p in cluster.primary_ports() if p not in ours)
            survivor = next(iter(ours))
            cluster.node(victim).stop(kill=True)
            await wait_until(lambda: b"cluster_state:fail" in _state(survivor), within_s=30)
            await anyio.sleep(1.0)  # blocked reads are unblocked with CLUSTERDOWN meanwhile
            cluster.node(victim).start()
            await anyio.to_thread.run_sync(cluster.wait_ok)
            await publisher.publish("ticks", Tick(resource="r", seq=2), resource_id="r")
            await wait_until(lambda: 2 in seen or bool(errors), within_s=60)
            stop.set()
        assert not errors, errors
        assert 2 in seen
