"""A Redis password never reaches an error, a log line or the terminal.

A private redis-server with ``requirepass``; the library and the CLI (``run``, ``stats``,
``publish``, ``tail``, ``dlq``) are given a wrong password and must say so without printing it.

No repr or str of a client eventbus makes (``bus.redis``, its pool and
connections; the Cluster client's nodes; the Spark source's client) shows the password, and the
client still authenticates with it (redis-py `CredentialProvider`, `eventbus.client.credentials`).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support import Tick
from typer.testing import CliRunner

from eventbus import EventBus, PublishError, RedisUnavailable, Settings
from eventbus.cli import app
from eventbus.client.connection import connect
from eventbus.spark.options import SourceOptions
from localredis.cluster import ReplicatedCluster
from localredis.server import RedisServer

PASSWORD = "p/ss#w0rd-s3cret"  # '/' and '#' need percent-encoding in a URL
ENCODED = "p%2Fss%23w0rd-s3cret"
WRONG = "wr0ng-s3cret-value"
RUNNER = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        with redis.Redis(port=srv.port) as client:
            client.config_set("requirepass", PASSWORD)
        yield srv


def _url(server: RedisServer, password: str) -> str:
    return f"redis://:{password}@127.0.0.1:{server.port}/0"


def _clean(text: str) -> None:
    for secret in (WRONG, PASSWORD, ENCODED):
        assert secret not in text
    assert "***" in text


USER = "svc-user"
USER_PASSWORD = "us3r-p@ss/w0rd"  # '@' and '/' percent-encoded in the URL
USER_ENCODED = "us3r-p%40ss%2Fw0rd"


@pytest.fixture
def acl_user(server: RedisServer) -> Iterator[str]:
    """A URL of an ACL user (not the default user) of the private server; the user is deleted
    afterwards."""
    with redis.Redis(port=server.port, password=PASSWORD) as client:
        client.acl_setuser(USER, enabled=True, passwords=[f"+{USER_PASSWORD}"],
                           keys=["*"], channels=["*"], commands=["+@all"])  # fmt: skip
        yield f"redis://{USER}:{USER_ENCODED}@127.0.0.1:{server.port}/0"
        client.acl_deluser(USER)


def _shows_no_password(*objects: object) -> None:
    for obj in objects:
        for text in (repr(obj), str(obj)):
            for secret in (PASSWORD, ENCODED, USER_PASSWORD, USER_ENCODED):
                assert secret not in text, text


def _pool_views(client: redis.Redis | redis.asyncio.Redis) -> list[object]:
    pool = client.connection_pool
    connections = [*pool._available_connections, *pool._in_use_connections]
    assert connections  # the client has connected: its live connections are shown too
    return [client, pool, pool.connection_kwargs, *connections]


@pytest.mark.anyio
@pytest.mark.parametrize("who", ["default user", "ACL user"])
async def test_the_client_of_a_bus_shows_no_password(
    server: RedisServer, acl_user: str, who: str
) -> None:
    url = _url(server, ENCODED) if who == "default user" else acl_user
    bus = EventBus(Settings(redis_url=url))
    async with bus:
        assert await bus.redis.ping()
        expected = "default" if who == "default user" else USER
        assert await bus.redis.acl_whoami() == expected
        _shows_no_password(*_pool_views(bus.redis), bus)
    await bus.aclose()


def test_the_spark_sources_client_shows_no_password(server: RedisServer, acl_user: str) -> None:
    options = SourceOptions.parse({"topic": "t", "store": "unused", "redisUrl": acl_user})
    with options.redis() as client:
        assert client.acl_whoami() == USER
        _shows_no_password(options, *_pool_views(client))


@pytest.fixture
def cluster_user(redis_cluster: ReplicatedCluster) -> Iterator[str]:
    """A URL of an ACL user with a password on every node of the session's cluster (deleted
    afterwards)."""
    for node in redis_cluster.nodes:
        with redis.Redis(port=node.port) as client:
            client.acl_setuser(USER, enabled=True, passwords=[f"+{USER_PASSWORD}"],
                               keys=["*"], channels=["*"], commands=["+@all"])  # fmt: skip
    yield f"redis://{USER}:{USER_ENCODED}@127.0.0.1:{redis_cluster.nodes[0].port}/0"
    for node in redis_cluster.nodes:
        with redis.Redis(port=node.port) as client:
            client.acl_deluser(USER)


@pytest.mark.anyio
async def test_the_cluster_client_shows_no_password(cluster_user: str) -> None:
    client = connect(Settings(redis_url=cluster_user, cluster=True))
    try:
        await client.set("{k}x", b"1")  # connects to the topology and to the key's primary
        assert await client.acl_whoami(target_nodes=client.RANDOM) == USER
        nodes = client.get_nodes()
        connections = [c for n in nodes for c in n._connections]
        assert connections
        _shows_no_password(
            client, client.connection_kwargs, client.nodes_manager, *nodes,
            *[n.connection_kwargs for n in nodes], *connections,
        )  # fmt: skip
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_library_errors_redact_the_password(server: RedisServer) -> None:
    bus = EventBus(Settings(redis_url=_url(server, WRONG), publish_timeout_s=0.5))
    with pytest.raises(RedisUnavailable) as info:
        async with bus:
            pass
    _clean(str(info.value))
    assert "invalid username-password" in str(info.value)
    with pytest.raises(PublishError) as failed:
        await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")
    for secret in (WRONG, PASSWORD, ENCODED):
        assert secret not in str(failed.value)
    assert WRONG not in repr(bus.settings) and "***" in repr(bus.settings)
    await bus.aclose()


@pytest.mark.anyio
async def test_a_percent_encoded_password_with_slash_and_hash_connects(
    server: RedisServer,
) -> None:
    bus = EventBus(Settings(redis_url=_url(server, ENCODED)))
    async with bus:
        assert await bus.redis.ping()
    await bus.aclose()


@pytest.mark.parametrize(
    "args",
    [
        ["stats"],
        ["tail", "orders"],
        ["publish", "orders", "--type", "T", "--resource-id", "r"],
        ["dlq", "list", "orders", "billing"],
    ],
)
def test_cli_commands_redact_the_password(server: RedisServer, args: list[str]) -> None:
    result = RUNNER.invoke(app, [*args, "--redis-url", _url(server, WRONG)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    _clean(result.output)


def test_cli_redacts_a_password_from_the_environment(server: RedisServer) -> None:
    result = RUNNER.invoke(app, ["stats"], env={"REDIS_URL": _url(server, WRONG), "COLUMNS": "200"})
    assert result.exit_code == 1
    _clean(result.output)


def test_eventbus_run_redacts_the_password(server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "svc.py").write_text(
        textwrap.dedent(
            """
            from eventbus import EventBus
            from pydantic import BaseModel

            bus = EventBus.from_env()

            class E(BaseModel):
                n: int

            @bus.subscriber("orders", group="billing")
            async def handle(event: E) -> None: ...
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "eventbus.cli", "run", "svc:bus", "--log-level", "debug"],
        cwd=tmp_path,
        env={"REDIS_URL": _url(server, WRONG), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output
    assert "invalid username-password" in output
    _clean(output)
