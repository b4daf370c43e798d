"""`EventBus.run` raises `RedisUnavailable` when Redis goes away between the start's ``PING``
and the topic registration (``TopicRegistry.ensure``'s ``HSETNX``), as when it cannot be reached
at all; it raised the raw ``redis.exceptions.ConnectionError`` before. Found by the long
``stress all`` chaos run (a consumer process replaced while the Sentinel primary restarted).

Deterministic: a fake server on loopback answers the connection handshake and ``PING`` and
closes the connection at the first other command.
"""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import BaseModel

from eventbus import Context, EventBus, Settings
from eventbus.errors import RedisUnavailable

pytestmark = pytest.mark.anyio


class Tick(BaseModel):
    n: int


async def _command(rx: BufferedByteReceiveStream) -> list[bytes]:
    header = await rx.receive_until(b"\r\n", 64)
    assert header.startswith(b"*"), header
    parts = []
    for _ in range(int(header[1:])):
        size = int((await rx.receive_until(b"\r\n", 64))[1:])
        parts.append(await rx.receive_exactly(size))
        await rx.receive_exactly(2)
    return parts


def _flat(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _flat(sub)]
    return [exc]


async def test_redis_lost_right_after_the_start_ping_raises_redis_unavailable() -> None:
    seen: list[bytes] = []

    async def serve(stream: SocketStream) -> None:
        rx = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    cmd = await _command(rx)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    return
                name = cmd[0].upper()
                seen.append(name)
                if name == b"CLIENT":
                    await stream.send(b"+OK\r\n")
                elif name == b"PING":
                    await stream.send(b"+PONG\r\n")
                else:  # Redis is gone: the connection closes without a reply
                    return

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    bus = EventBus(Settings(redis_url=f"redis://127.0.0.1:{port}/0", shards=4))

    @bus.subscriber("ticks", group="g")
    async def handle(event: Tick, ctx: Context) -> None:  # never called
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        with anyio.fail_after(20):
            try:
                await bus.run()
            except BaseException as exc:  # inspected below
                raised = _flat(exc)
            else:
                raised = []
        tg.cancel_scope.cancel()
    assert b"PING" in seen and seen[-1] == b"HSETNX", seen  # lost at the registration
    assert raised and all(isinstance(e, RedisUnavailable) for e in raised), raised
