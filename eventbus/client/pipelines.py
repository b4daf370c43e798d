"""Running a redis-py pipeline without losing the server's reason for an error reply.

When a pipeline raises its first error reply, redis-py (6.4 at least) replaces the exception's
message with a template it never fills in: "Command # 1 (XAUTOCLAIM ...) of pipeline caused
error: {exception.args}". The server's words (NOGROUP, NOPERM, OOM, WRONGTYPE...) are gone, and
with them what callers must tell apart (a missing group is recreated, a refusal is not). With
``raise_on_error=False`` the replies hold the exceptions as the parser made them; `execute`
raises the first of those instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import hiredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ResponseError


async def execute(pipe: Any, *, raise_on_error: bool = True) -> list[Any]:
    """``await pipe.execute()``, raising the first error reply with the server's own message
    (connection errors propagate as redis-py raises them); with `raise_on_error` False, error
    replies are returned in their places, as `ResponseError` values."""
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    for reply in replies if raise_on_error else ():
        if isinstance(reply, Exception):
            raise reply
    return replies


_PACKED = (Connection, SSLConnection, UnixDomainSocketConnection)
pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)
"""Pack one command (a tuple of bytes, str or int) as RESP, in C."""


def packable(redis: Any) -> bool:
    """Whether `redis` is redis-py's single-node asyncio client on plain connections (TCP, TLS,
    Unix socket): commands can then be packed here and written on one of its connections."""
    pool = getattr(redis, "connection_pool", None)
    return type(redis) is Redis and issubclass(getattr(pool, "connection_class", object), _PACKED)


class Packed(NamedTuple):
    """A command packed once, to be sent many times (`execute_packed` writes `data` on a single
    node, and sends `args` through a pipeline elsewhere)."""

    args: tuple[Any, ...]
    data: bytes

    @classmethod
    def of(cls, *args: Any) -> Packed:
        return cls(args, pack(args))


async def execute_packed(
    redis: Any,
    commands: Sequence[tuple[Any, ...] | Packed],
    *,
    raise_on_error: bool = True,
    conn: Any = None,
) -> list[Any]:
    """Run `commands` in one round trip, as `execute` runs a pipeline: the replies, or the first
    error reply raised with the server's message (with `raise_on_error` False, error replies
    are returned in their places, as `ResponseError` values). On a single node they are packed with
    hiredis's C packer and written on a pooled connection (redis-py's asyncio client packs in
    Python, about half a microsecond per argument: an XACK of 500 entry IDs); elsewhere (a
    Cluster, fakeredis) through a redis-py pipeline. A `Packed` command is sent as packed
    before. `conn`: a connection of `redis`'s pool the caller holds (`HeldConnection`), used
    instead of one taken from the pool for this call. A connection error drops the connection
    (its replies may be half read) and propagates."""
    if not packable(redis):
        pipe = redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*(command.args if isinstance(command, Packed) else command))
        return await execute(pipe, raise_on_error=raise_on_error)
    pool = redis.connection_pool
    pooled = conn is None  # else the caller's own connection (`HeldConnection`)
    if pooled:
        conn = await pool.get_connection()
    replies: list[Any] = []
    try:
        await conn.send_packed_command(
            b"".join([pack(c) if type(c) is tuple else c.data for c in commands])  # type: ignore[union-attr]
        )
        gets = buffered_replies(conn)  # replies already read: no coroutine per reply
        for _ in commands:
            reply = gets() if gets is not None else NOT_READ
            if reply is NOT_READ:
                try:
                    reply = await conn.read_response()
                except ResponseError as exc:  # this command's error: the others' replies follow
                    reply = exc
            elif isinstance(reply, Exception) and not isinstance(reply, ResponseError):
                raise reply  # e.g. a ConnectionError the reader made: as read_response raises
            replies.append(reply)
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        if pooled:
            await pool.release(conn)
    for reply in replies if raise_on_error else ():
        if isinstance(reply, Exception):
            raise reply
    return replies


class HeldConnection:
    """One connection of `redis`'s pool kept by one caller for its repeated round trips
    (`execute` as `execute_packed`): no pool checkout per round trip, whose health check
    (redis-py's ``can_read_destructive``: a zero timeout around a socket read, a cancelled
    read per checkout) costs more than a small round trip's own Python work. A round trip that
    fails drops the connection (`execute_packed`); the next one connects it again. Elsewhere
    than a single node's plain connections (`packable`), every call goes through
    `execute_packed` as before. Not for concurrent use: one round trip at a time."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.packable = packable(redis)
        self.conn: Any = None

    async def execute(
        self, commands: Sequence[tuple[Any, ...] | Packed], *, raise_on_error: bool = True
    ) -> list[Any]:
        """`execute_packed` on the held connection (taken from the pool at the first call)."""
        if not self.packable:
            return await execute_packed(self.redis, commands, raise_on_error=raise_on_error)
        if self.conn is None:
            self.conn = await self.redis.connection_pool.get_connection()
        return await execute_packed(
            self.redis, commands, raise_on_error=raise_on_error, conn=self.conn
        )

    async def aclose(self) -> None:
        """Give the connection back to the pool."""
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.redis.connection_pool.release(conn)


NOT_READ: Any = NOT_ENOUGH_DATA
"""What a hiredis reader's ``gets`` returns when no whole reply is buffered."""


def buffered_replies(conn: Any) -> Callable[[], Any] | None:
    """The ``gets`` of `conn`'s hiredis reader (the next whole reply in its buffer, else
    `NOT_READ`; a reply error as a `ResponseError` value, not raised), or None where that is
    not redis-py's RESP2 hiredis parser (RESP3 replies may be push messages: read_response)."""
    parser = getattr(conn, "_parser", None)
    if type(parser) is not _AsyncHiredisParser or conn.protocol in (3, "3"):
        return None
    if not parser._connected:  # read_response raises then, even with replies buffered
        return None
    reader = getattr(parser, "_reader", None)
    return None if reader is None else cast("Callable[[], Any]", reader.gets)
