"""Blocking reads on a Redis Cluster, where one ``XREADGROUP`` may not span slots.

The shard streams of a topic carry no hashtag (`eventbus.protocol.keys`): each hashes to its own
slot, so they spread over every primary. A Cluster refuses a multi-slot ``XREADGROUP``, so a
consumer cannot block on all its shards with one command as it does on a single node. Instead, a
read round (`Reader.read`, `BlockingReads.read`) first sends, per node, one pipeline of

    XREADGROUP GROUP <g> <me> COUNT <n> [NOACK] STREAMS <stream> >
    XPENDING <stream> <g>                       (fenced delivery; not with NOACK)

for each held stream on that node (no BLOCK: a busy consumer costs one write per node per
round). If that found nothing, it sends the same pair with ``BLOCK <ms>`` for every held stream
at once, each on a connection of its own to the stream's node. Either way each summary runs after
its read, on the stream's node, as on a single node. The first read that
returns entries (or fails) ends the others: ``CLIENT UNBLOCK <id> TIMEOUT`` on their node makes
a blocked read return empty, delivering nothing (a read already served is not affected: its
entries come back as usual). So an entry reaches the consumer as soon as it is added, with no
polling, and a round ends within a round trip of the first entry.

Connections: one per held shard stream (at most the topic's shard count per consumer), plus one
per node for the non-blocking pipelines and ``CLIENT UNBLOCK``; made on first use, moved when a
stream's slot moves (``MOVED`` refreshes the client's slot map), closed by `aclose`. A stream
whose slot is migrating (``ASK``, ``TRYAGAIN``) is left out of that round (its entries wait for
the next one).

Not through redis-py's cluster pipeline: it finds the keys of ``XREADGROUP`` (a command with
movable keys) by sending ``COMMAND GETKEYS`` to the server, one round trip per command.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, cast

import anyio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, MovedError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from eventbus.consumer.raw_replies import (
    client_id,
    delivered,
    detached_connection,
    next_reply,
    pack,
    parse_xpending,
    parse_xread,
)
from eventbus.locking.member import Member

log = logging.getLogger("eventbus.consumer")

_REDIRECT = (AskError, TryAgainError)  # MovedError is an AskError


@dataclass(slots=True)
class _Conn:
    node: str
    conn: Any
    client_id: int | None = None
    blocked: bool = False


class BlockingReads:
    """One blocking read per stream, concurrently, ended early by ``CLIENT UNBLOCK``."""

    def __init__(self, member: Member, count: int, noack: bool) -> None:
        # used only on a Cluster (`Settings.cluster`): the client is then a RedisCluster
        self.redis = cast("RedisCluster", member.redis)
        self.group, self.consumer_id = member.group, member.consumer_id
        self.count = count
        self.noack = noack
        self._reads: dict[str, _Conn] = {}
        self._control: dict[str, _Conn] = {}

    async def read(
        self, streams: list[str], block_ms: int
    ) -> tuple[list[tuple[bytes, Any]], list[Any]]:
        """New entries of `streams`, blocking at most `block_ms` when there are none: the
        XREADGROUP replies with entries, and the XPENDING summaries in `streams` order (none
        with NOACK). Raises the first error that is not a slot redirect."""
        replies, summaries = await self._poll(streams)
        me = self.consumer_id.encode()
        if any(entries for _, entries in replies) or any(
            c["name"] != me and c["pending"] for s in summaries for c in s["consumers"]
        ):
            return replies, summaries
        return await self._block(streams, block_ms)

    async def _poll(self, streams: list[str]) -> tuple[list[tuple[bytes, Any]], list[Any]]:
        """The non-blocking pass: one pipeline per node, the nodes at once."""
        by_node: dict[str, list[int]] = {}
        for i, stream in enumerate(streams):
            by_node.setdefault((await self._node_of(stream)).name, []).append(i)
        replies: list[tuple[bytes, Any]] = []
        summaries: list[Any] = [{"consumers": []}] * len(streams)
        errors: list[BaseException] = []

        async def node(name: str, indexes: list[int]) -> None:
            ctl = self._control_conn(name)
            payload = b"".join(self._commands(streams[i], None) for i in indexes)
            try:
                await ctl.conn.send_packed_command(payload)
                got = [await next_reply(ctl.conn) for _ in range(len(indexes) * self._per_read)]
            except Exception as exc:  # replies may be half read: never reuse the connection
                self._control.pop(name, None)
                await ctl.conn.disconnect()
                errors.append(exc)
                await self._lost(exc)
                return
            for k, i in enumerate(indexes):
                read = got[k * self._per_read : (k + 1) * self._per_read]
                bad = next((r for r in read if isinstance(r, Exception)), None)
                if bad is not None and delivered(read[0]):
                    errors.append(_read_lost(streams[i], bad))
                elif isinstance(bad, _REDIRECT):
                    await self._redirected(streams[i], bad)
                elif bad is not None:
                    errors.append(bad)
                else:
                    replies.extend(parse_xread(read[0]))
                    if not self.noack:
                        summaries[i] = parse_xpending(read[1])

        async with anyio.create_task_group() as tg:
            for name, indexes in by_node.items():
                tg.start_soon(node, name, indexes)
        if errors:
            raise _failed(errors[0], replies)
        return replies, [] if self.noack else summaries

    @property
    def _per_read(self) -> int:
        return 1 if self.noack else 2

    def _commands(self, stream: str, block_ms: int | None) -> bytes:
        """XREADGROUP (with BLOCK unless `block_ms` is None) and, unless NOACK, XPENDING."""
        command: tuple[Any, ...] = (b"XREADGROUP", b"GROUP", self.group, self.consumer_id)
        command += (b"COUNT", self.count)
        command += (b"BLOCK", block_ms) if block_ms is not None else ()
        command += (b"NOACK",) if self.noack else ()
        payload = pack((*command, b"STREAMS", stream, b">"))
        if not self.noack:
            payload += pack((b"XPENDING", stream, self.group))
        return payload

    def _control_conn(self, node: str) -> _Conn:
        ctl = self._control.get(node)
        if ctl is None:
            ctl = self._control[node] = _Conn(
                node, detached_connection(self.redis.get_node(node_name=node))
            )
        return ctl

    async def _block(
        self, streams: list[str], block_ms: int
    ) -> tuple[list[tuple[bytes, Any]], list[Any]]:
        """The blocking pass: one read per stream at once, the first with entries ending the
        others."""
        replies: list[tuple[bytes, Any]] = []
        summaries: list[Any] = [None] * len(streams)
        errors: list[BaseException] = []
        ended = False  # the first read with entries (or an error) ends the others, once

        async def one(i: int, stream: str) -> None:
            nonlocal ended
            try:
                got, summaries[i] = await self._read_one(stream, block_ms)
            except _REDIRECT as exc:
                await self._redirected(stream, exc)
                return
            except ResponseError as exc:
                if str(exc).startswith("UNBLOCKED"):
                    # the stream's key left this node while the read was blocked (a slot migrated)
                    await self._redirected(stream, exc)
                    return
                # refused (CLUSTERDOWN while a failed primary is replaced, NOPERM, ...): raised
                # after the task group, ungrouped, so the read loop backs off as for any refusal
                errors.append(exc)
                got = None
            except Exception as exc:
                errors.append(exc)
                await self._lost(exc)
                got = None
            else:
                if not got:
                    return
                replies.extend(got)
            if not ended:
                ended = True
                await self._unblock(stream)

        async with anyio.create_task_group() as tg:
            for i, stream in enumerate(streams):
                tg.start_soon(one, i, stream)
        if errors:
            raise _failed(errors[0], replies)
        if self.noack:
            return replies, []
        return replies, [s if s is not None else {"consumers": []} for s in summaries]

    async def _read_one(self, stream: str, block_ms: int) -> tuple[Any, Any]:
        c = await self._connection(stream)
        payload = self._commands(stream, block_ms)
        c.blocked = True  # before sending: an unblock may then come too early, never too late
        try:
            await c.conn.send_packed_command(payload, check_health=False)
            first = await next_reply(c.conn)
            c.blocked = False
            second = None if self.noack else await next_reply(c.conn)
        except BaseException:  # replies may be half read: never reuse the connection
            c.blocked = False
            await self._drop(stream)
            raise
        if isinstance(second, Exception) and delivered(first):
            raise _read_lost(stream, second)
        for reply in (first, second):
            if isinstance(reply, Exception):
                raise reply
        return parse_xread(first), None if self.noack else parse_xpending(second)

    async def _node_of(self, stream: str) -> Any:
        """The primary serving `stream`'s slot (the slot map is loaded first when empty)."""
        if not self.redis.nodes_manager.slots_cache:
            await self.redis.initialize()
        return self.redis.get_node_from_key(stream)

    async def _connection(self, stream: str) -> _Conn:
        node = await self._node_of(stream)
        c = self._reads.get(stream)
        if c is not None and c.node != node.name:
            await self._drop(stream)
            c = None
        if c is None:
            c = self._reads[stream] = _Conn(node.name, detached_connection(node))
        if c.client_id is None or not c.conn.is_connected:
            c.client_id = await client_id(c.conn)
        return c

    async def _unblock(self, done: str) -> None:
        """``CLIENT UNBLOCK ... TIMEOUT`` every read still blocked, other than `done`'s, one
        pipeline per node, written to every node before any reply is read."""
        by_node: dict[str, list[int]] = {}
        for stream, c in self._reads.items():
            if stream != done and c.blocked and c.client_id is not None:
                by_node.setdefault(c.node, []).append(c.client_id)
        sent: list[tuple[_Conn, int]] = []
        for node, ids in by_node.items():
            ctl = self._control_conn(node)
            try:
                payload = b"".join(pack((b"CLIENT", b"UNBLOCK", i, b"TIMEOUT")) for i in ids)
                await ctl.conn.send_packed_command(payload)
                sent.append((ctl, len(ids)))
            except Exception as exc:  # the blocked reads then end at their timeout
                await self._control_failed(ctl, exc)
        for ctl, n in sent:
            try:
                for _ in range(n):
                    await next_reply(ctl.conn)
            except Exception as exc:
                await self._control_failed(ctl, exc)

    async def _control_failed(self, ctl: _Conn, exc: Exception) -> None:
        log.debug("CLIENT UNBLOCK on %s failed: %s", ctl.node, exc)
        await ctl.conn.disconnect()
        self._control.pop(ctl.node, None)

    async def _redirected(self, stream: str, exc: ResponseError) -> None:
        """The stream's slot moved (or is moving): forget its connection; on ``MOVED`` let
        the client reload its slot map so the next read goes to the new owner."""
        log.info("blocking read of %s redirected (%s)", stream, exc)
        await self._drop(stream)
        if isinstance(exc, MovedError):
            with contextlib.suppress(Exception):
                await self.redis.nodes_manager.initialize()

    async def _lost(self, exc: Exception) -> None:
        """A node did not answer: reload the slot map (its replica may serve the slots now);
        the caller's round fails and the consumer retries after its backoff."""
        if isinstance(exc, (ConnectionError, TimeoutError, RedisConnectionError, RedisTimeout)):
            with contextlib.suppress(Exception):
                await self.redis.nodes_manager.initialize()

    async def _drop(self, stream: str) -> None:
        c = self._reads.pop(stream, None)
        if c is not None:
            with contextlib.suppress(Exception):
                await c.conn.disconnect()

    async def aclose(self) -> None:
        """Close every connection of these reads."""
        for c in [*self._reads.values(), *self._control.values()]:
            with contextlib.suppress(Exception):
                await c.conn.disconnect()
        self._reads.clear()
        self._control.clear()


def _failed(error: BaseException, replies: list[tuple[bytes, Any]]) -> BaseException:
    """The error a failed read round raises. When other streams' reads of the round delivered
    entries, those are not dispatched: the round must fail like a lost reply (a connection
    error), so the consumer claims its PELs again, in order, before reading on."""
    if any(rows for _, rows in replies):
        return RedisConnectionError(
            f"a read failed ({type(error).__name__}: {error}) after others delivered entries: "
            "their PELs are claimed again"
        )
    return error


def _read_lost(stream: str, exc: Exception) -> RedisConnectionError:
    """The read of `stream` delivered entries but its XPENDING check failed (the slot moved in
    between): the entries are not dispatched, so the round fails like a lost reply, and the
    consumer forgets its shards and claims their PELs again, in order, before reading on (else
    a later read would hand out the next entries while these wait in the PEL)."""
    return RedisConnectionError(
        f"{stream}: entries read, then {type(exc).__name__} ({exc}): its PEL is claimed again"
    )
