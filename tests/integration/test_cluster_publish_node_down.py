"""Publishing on a Redis Cluster while one primary is down: the XADDs the live primaries took
are stored once, not once per retry of the batch.

A batch's XADDs go to several primaries. When one of them cannot be reached, redis-py's cluster
pipeline raises for the whole batch (``asyncio.gather`` without ``return_exceptions``), and it
retries the commands without a result itself. Sending the batch as one pipeline, every retry
of the publisher's flusher (until ``publish_timeout_s``) stored the live primaries' entries
again. `eventbus.publishing.wire` sends one pipeline per primary: a failed primary leaves only its
own slots to be sent again.

Deterministic: a 3-primary cluster without replicas, ``cluster-require-full-coverage no`` (the
live primaries keep serving their slots), one primary SIGKILLed before ``publish_many``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import redis
from support import Tick

from eventbus import EventBus, PublishError, Settings
from eventbus.protocol.sharding import shard_of
from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.anyio

SHARDS = 8


async def test_live_primaries_store_a_batch_once_while_another_is_down() -> None:
    with ReplicatedCluster(3, 0) as cluster:
        for port in cluster.primary_ports():
            with redis.Redis(port=port) as r:
                r.config_set("cluster-require-full-coverage", "no")
        settings = Settings(
            redis_url=cluster.url, cluster=True, shards=SHARDS, publish_timeout_s=3,
            retry_base_s=0.02, retry_max_s=0.2,
        )  # fmt: skip
        bus = EventBus(settings)
        streams = [bus.keys.stream("orders", s) for s in range(SHARDS)]

        def stream_of(rid: str) -> str:
            return streams[shard_of(rid, SHARDS)]

        async with bus:
            await bus.publish("orders", Tick(resource="warm", seq=0), resource_id="warm")
            down = cluster.primary_of(streams[0])
            up = {s for s in streams if cluster.primary_of(s) != down}
            assert up, "every shard stream on one primary: nothing to check"
            cluster.node(down).stop(kill=True)

            # the first batch meets the open connection to the killed node (a lost reply),
            # the second a refused connect (redis-py's pipeline raises for every node)
            events, ids = [], []
            for batch in range(2):
                some = [(f"r{i}", Tick(resource=f"r{i}", seq=batch)) for i in range(200)]
                with pytest.raises(PublishError) as raised:
                    await bus.publish_many("orders", some)
                events += some
                ids += raised.value.entry_ids or []

        sent_up = Counter(stream_of(rid) for rid, _ in events if stream_of(rid) in up)
        stored = {s: n for s in up if (n := _xlen(cluster, s))}
        warm = Counter([stream_of("warm")] if stream_of("warm") in up else [])
        assert stored == dict(sent_up + warm)  # each event once (the warm-up one too)
        assert sum(i is not None for i in ids) == sum(sent_up.values())  # confirmed: the live ones


def _xlen(cluster: ReplicatedCluster, stream: str) -> int:
    with redis.Redis(port=cluster.primary_of(stream)) as r:
        return int(r.xlen(stream))
