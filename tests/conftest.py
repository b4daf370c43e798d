"""Shared fixtures: a real Redis for integration tests, a fakeredis for fast unit tests.

Redis for integration tests, in order of preference:

1. ``REDIS_URL`` from the environment: an existing server. Tests FLUSHDB it, so point it at a
   throw-away database.
2. testcontainers' ``redis:7`` image, when a Docker engine answers.
3. A private ``redis-server`` on a free loopback port (`localredis.server.RedisServer`).

The server is started once per session; each test gets a flushed database. The 3-node Redis
Cluster (`redis_cluster`) is started only by the tests that ask for it.

Topologies: the integration suite's core (the modules in `BOTH_TOPOLOGIES`) runs on a
single node and on the 3-primary cluster: `redis_db`, `r` and `settings` follow the `topology`
fixture ("single" or "cluster"); on the cluster ``EVENTBUS_CLUSTER=true`` is set for the test, so
every `Settings()`, CLI call and child process of the test uses the Cluster client. A test whose
behaviour cannot hold on a cluster says why with ``@pytest.mark.single_node("reason")`` (skipped
there; docs/operations.md lists them). Other tests run on the single node only.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from eventbus.config import Settings
from localredis.cluster import ReplicatedCluster
from localredis.server import RedisServer

BOTH_TOPOLOGIES = {
    "test_publish",
    "test_pipelines",
    "test_publish_order",
    "test_consume",
    "test_consume_redis",
    "test_takeover",
    "test_failure_policy",
    "test_shutdown",
    "test_cli",
    "test_fenced_reads",
    "test_trims",
    "test_lifecycle",
    "test_tier_offload",
    "test_tier_catchup",
    "test_consumer_catchup",
    "test_catchup_handling",
    "test_tier_cli",
    "test_broadcast_redis",
    "test_batch_redis",
    "test_routing_redis",
    "test_request_reply",
    "test_request_reply_redis",
    "test_retention",
    "test_examples",
    "test_outbox",
    "test_dictionaries",
    "test_metrics_health",
    "test_acl_roles",
}
"""Integration modules run on both topologies (by module name)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "single_node(reason): cannot hold on a Redis Cluster (skipped there, why)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "topology" in metafunc.fixturenames and metafunc.module.__name__.rpartition(".")[2] in (
        BOTH_TOPOLOGIES
    ):
        metafunc.parametrize("topology", ["single", "cluster"], indirect=True)


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> str:
    """ "single" or "cluster" (see the module docstring); skips a ``single_node`` test on the
    cluster with its reason."""
    name = str(getattr(request, "param", "single"))
    if name == "cluster":
        marker = request.node.get_closest_marker("single_node")
        if marker is not None:
            pytest.skip(f"single node only: {marker.args[0] if marker.args else ''}")
        request.getfixturevalue("monkeypatch").setenv("EVENTBUS_CLUSTER", "true")
    return name


SPARK_TESTS = "tests/spark/"
"""Test IDs starting so share one pytest-xdist worker (`pytest_xdist_make_scheduler`)."""


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown without it (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup`` (scripts/dev.sh test) every test of tests/spark runs on one
    worker, first (the largest group goes first): its SparkSession is a JVM of about 1 GiB and
    15 s to start, and a session per worker cost more than it spread (with one on each of 4
    workers at load 14, py4j calls failed). Other tests go one by one to the next free worker.

    By test ID, not by an ``xdist_group`` mark: pytest-xdist 3.8 names a marked test by
    rewriting ``item._nodeid``, which pytest 9 no longer reads, so marks group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    class SparkTogether(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return "spark" if nodeid.startswith(SPARK_TESTS) else super()._split_scope(nodeid)

    return SparkTogether(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(report: pytest.TestReport) -> Generator[None, Any, Any]:
    """A report as pytest-xdist sends it from a worker, its texts made UTF-8 encodable.

    Tests of text decoded with ``surrogateescape`` (a lone surrogate: file names, a peer's bytes)
    log it; execnet cannot encode such a captured log, and the worker stopped the whole run with
    an INTERNALERROR. A lone surrogate is shown as its backslash escape instead."""
    data = yield
    return _utf8_safe(data)


def _utf8_safe(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {key: _utf8_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_utf8_safe(item) for item in value)
    return value


pytest_plugins = ["pytester"]  # tests of eventbus.testing.pytest_plugin


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def _docker_redis() -> Iterator[str] | None:
    """A redis container's URL generator, or None when no Docker engine answers."""
    try:
        import docker

        docker.from_env(timeout=2).ping()
        from testcontainers.community.redis import RedisContainer
    except Exception:  # no Docker SDK, no engine, or no testcontainers: use the local binary
        return None

    def gen() -> Iterator[str]:
        with RedisContainer("redis:7") as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"

    return gen()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the session's Redis server (see the module docstring)."""
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    container = _docker_redis()
    if container is not None:
        yield from container
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_db(topology: str, request: pytest.FixtureRequest) -> str:
    """The session's Redis URL, its database flushed for this test (on the cluster: the
    session's cluster, every primary flushed)."""
    if topology == "cluster":
        cluster: ReplicatedCluster = request.getfixturevalue("redis_cluster")
        for node in cluster.nodes:
            with redis.Redis(port=node.port) as client:
                client.flushall()
        return cluster.url
    redis_url: str = request.getfixturevalue("redis_url")
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    return redis_url


@pytest.fixture
async def r(redis_db: str, topology: str) -> AsyncIterator[Any]:
    """A binary-safe asyncio client of the session's Redis, on a freshly flushed database (a
    `redis.asyncio.RedisCluster` on the cluster)."""
    if topology == "cluster":
        from redis.asyncio.cluster import RedisCluster as ClusterClient

        client: Any = ClusterClient.from_url(redis_db)
    else:
        client = redis.asyncio.Redis.from_url(redis_db)
    yield client
    await client.aclose()


@pytest.fixture
def settings(redis_db: str, topology: str) -> Callable[..., Settings]:
    """Factory of `Settings` for the session's Redis (database flushed), with small defaults
    that keep tests fast: 4 shards, short polls and retries. Keyword arguments override."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "redis_url": redis_db,
            "cluster": topology == "cluster",
            "shards": 4,
            "block_max_ms": 100,
            "retry_base_s": 0.01,
            "retry_max_s": 0.05,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ReplicatedCluster]:
    """A 3-primary Redis Cluster on loopback (about 2 s to start), shared by the session (ports
    chosen with their cluster-bus port free: `localredis.cluster`)."""
    with ReplicatedCluster(3, 0) as cluster:
        yield cluster


@pytest.fixture
async def fake_redis() -> AsyncIterator[Any]:
    """An in-memory fakeredis with Lua (lupa): for unit tests of script logic only."""
    import fakeredis

    client = fakeredis.aioredis.FakeRedis()
    yield client
    await client.aclose()
