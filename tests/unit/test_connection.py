"""`eventbus.client.connection`: a write to Redis is bounded by ``socket_timeout`` and by the
bytes a connection may hold unsent.

`timed_send` replaces redis-py's `asyncio.wait_for` around a write (a Task per command on
Python 3.11) by a timer, and redis-py's ``writelines`` (which on CPython 3.12.0-3.12.8 and
3.13.0-3.13.1 never pauses the protocol, so ``drain()`` never waits) by ``write``. These tests
hold it to redis-py's contract on a real loopback socket whose peer, another process, accepts
and never reads, so the kernel's buffers fill and a write cannot finish; on asyncio's own
event loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus import Settings
from eventbus.client.connection import connect, timed_send

pytestmark = pytest.mark.anyio

_DEAF_PEER = """
import socket
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
held = []
while True:
    held.append(server.accept()[0])  # kept open, never read
"""


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    if request.param != "asyncio":
        pytest.importorskip("uvloop")
    return request.param


@pytest.fixture
def deaf_port() -> Iterator[int]:
    """A loopback TCP server in another process that accepts connections and never reads."""
    peer = subprocess.Popen([sys.executable, "-c", _DEAF_PEER], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        yield int(peer.stdout.readline())
    finally:
        peer.kill()
        peer.wait()


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
    writer = conn._writer
    assert writer is not None
    command = b"x" * (64 << 20)  # far more than loopback's socket buffers can take
    started = time.monotonic()
    # a hang fails here (minutes, not seconds: copying 64 MiB at load 14 took seconds)
    with anyio.fail_after(120), pytest.raises(RedisTimeoutError, match="Timeout writing"):
        await conn.send_packed_command([command], check_health=False)
    assert time.monotonic() - started >= 0.3  # it waited for the socket timeout
    assert not conn.is_connected  # a partial command is never followed by another one
    # aborted, not closed: a graceful close would keep the socket and its unsent bytes until
    # the peer reads (here: never, so this wait would time out)
    await asyncio.wait_for(writer.wait_closed(), 10)
    assert writer.transport.get_write_buffer_size() == 0


async def test_writes_the_peer_never_reads_buffer_at_most_the_high_water_mark(
    deaf_port: int,
) -> None:
    """Each write returns with at most the transport's high-water mark unsent; once the
    kernel's buffers are full, the next write waits for the peer and fails at the deadline,
    long before the 256 MiB offered are buffered."""
    conn = _connection(deaf_port, 0.3)
    await conn.connect()  # type: ignore[no-untyped-call]
    transport = conn._writer.transport  # type: ignore[union-attr]
    high_water = transport.get_write_buffer_limits()[1]
    unsent: list[int] = []
    with pytest.raises(RedisTimeoutError, match="Timeout writing to socket"):
        for _ in range(256):
            await conn.send_packed_command([b"x" * (1 << 20)], check_health=False)
            unsent.append(transport.get_write_buffer_size())
    assert max(unsent, default=0) <= high_water, unsent
    assert not conn.is_connected


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
