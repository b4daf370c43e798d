"""A Redis Cluster with one replica per primary (6 processes, `localredis.cluster`):
`publish_replicas` confirms each batch on every node that took its XADDs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import Tick

from eventbus import EventBus, PublishError, Settings
from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.anyio

SHARDS = 6


@pytest.fixture(scope="module")
def replicated() -> Iterator[ReplicatedCluster]:
    with ReplicatedCluster(3, 1) as cluster:
        yield cluster


def _settings(cluster: ReplicatedCluster, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "redis_url": cluster.url,
        "cluster": True,
        "shards": SHARDS,
        "publish_replicas": 1,
        "publish_replicas_timeout_ms": 2000,
        "retry_base_s": 0.01,
        "retry_max_s": 0.05,
    }
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


async def test_publish_replicas_waits_on_every_node_of_the_batch(
    replicated: ReplicatedCluster,
) -> None:
    """Every shard's stream (on all three primaries) holds its events on the primary's replica
    once publish returns: WAIT went to each node that took XADDs, on the same connection."""
    import redis

    bus = EventBus(_settings(replicated))
    events = [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(60)]
    async with bus:
        await bus.publish("w", Tick(resource="solo", seq=0), resource_id="solo")  # topic check
        for port in replicated.primary_ports():
            redis.Redis(port=port).config_resetstat()
        ids = await bus.publish_many("w", events)  # one batch, XADDs on every primary
    await bus.aclose()
    assert len(ids) == 60
    streams = [bus.keys.stream("w", s) for s in range(SHARDS)]
    primaries = {replicated.primary_of(st) for st in streams}
    assert len(primaries) == 3  # the batch spread over every primary
    for port in primaries:  # each node that took XADDs got its WAIT
        stats = redis.Redis(port=port).info("commandstats")
        assert stats["cmdstat_wait"]["calls"] >= 1, (port, stats)
    for st in streams:
        replica = replicated.replica_of(replicated.primary_of(st))
        with redis.Redis(port=replica) as r:
            r.execute_command("READONLY")
            on_primary = redis.Redis(port=replicated.primary_of(st)).xlen(st)
            assert r.xlen(st) == on_primary > 0  # no lag to wait for: WAIT confirmed it


async def test_publish_replicas_fails_when_a_node_has_too_few_replicas(
    replicated: ReplicatedCluster,
) -> None:
    """Asking for 2 replicas where each primary has 1: every publish of the batch fails with
    PublishError (the events are on the primaries), whichever node answered short."""
    bus = EventBus(_settings(replicated, publish_replicas=2, publish_replicas_timeout_ms=50))
    async with bus:
        with pytest.raises(PublishError, match="replicas confirmed"):
            await bus.publish("w2", Tick(resource="a", seq=0), resource_id="a")
    await bus.aclose()
