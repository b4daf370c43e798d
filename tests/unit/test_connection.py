"""`eventbus.client.connection`: a write to Redis is bounded by ``socket_timeout``.

`timed_send` replaces redis-py's `asyncio.wait_for` around a write (a Task per command on
Python 3.11) by a timer; these tests hold it to redis-py's contract on a real loopback socket
whose peer never reads, so the kernel's buffers fill and the write cannot finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus import Settings
from eventbus.client.connection import connect, timed_send

pytestmark = pytest.mark.anyio


@pytest.fixture
async def deaf_port() -> AsyncIterator[int]:
    """A loopback TCP server that accepts connections and never reads from them."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # kept open, never read

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


def _connection(port: int, timeout: float | None) -> Connection:
    # no CLIENT SETINFO on connect: the peer never answers it
    cls = timed_send(Connection)
    conn: Connection = cls(
        host="127.0.0.1", port=port, socket_timeout=timeout, lib_name=None, lib_version=None
    )
    return conn


async def test_a_write_the_peer_never_reads_fails_at_the_socket_timeout(deaf_port: int) -> None:
    conn = _connection(deaf_port, 0.3)
    await conn.connect()  # type: ignore[no-untyped-call]
    started = time.monotonic()
    with pytest.raises(RedisTimeoutError, match="Timeout writing to socket"):
        await conn.send_packed_command([b"x" * (256 << 20)], check_health=False)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 10  # the deadline, not a hang (a hang is caught at 10 s)
    assert not conn.is_connected  # a partial command is never followed by another one


async def test_a_write_to_a_closed_peer_is_a_connection_error() -> None:
    closed = asyncio.Event()

    def hang_up(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()  # RST: the next writes fail
        closed.set()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    conn = _connection(server.sockets[0].getsockname()[1], 1.0)
    await conn.connect()  # type: ignore[no-untyped-call]
    await closed.wait()
    server.close()
    with pytest.raises(RedisConnectionError):
        for _ in range(200):  # the reset reaches this end of the socket asynchronously
            await conn.send_packed_command([b"x" * (1 << 16)], check_health=False)
            await asyncio.sleep(0.01)
    assert not conn.is_connected


def test_every_plain_client_writes_with_a_timer() -> None:
    """Wiring (its speed is measured by stress/ab.sh): whichever the URL scheme."""
    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/none.sock"):
        cls = connect(Settings(redis_url=url)).connection_pool.connection_class
        assert cls.__name__.startswith("TimedSend"), (url, cls)
