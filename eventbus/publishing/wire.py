"""How one batch of publishes goes over the wire: XADDs packed with hiredis's C packer and their
replies read in order on one connection, or redis-py's pipeline (fakeredis; on a Redis Cluster
one per primary), and the ``WAIT`` of ``publish_replicas``.

redis-py's asyncio client packs commands in pure Python, which measured 3.5x slower here (42k vs
148k XADD/s), hence the C packer on a single node. With ``publish_replicas = N`` a batch ends with
``WAIT N timeout`` (https://redis.io/docs/latest/commands/wait/) on the connection that took its
XADDs (on a Cluster one per node, `eventbus.publishing.cluster_wait`); when fewer than N replicas
confirm, every publish of the batch raises `PublishError` (the events are on the primary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import hiredis
from redis.exceptions import ResponseError

from eventbus.client.pipelines import NOT_READ, buffered_replies
from eventbus.client.retry import LOST_REPLY
from eventbus.config import Settings
from eventbus.errors import PublishError
from eventbus.ops.metrics import observe_publish
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE
from eventbus.publishing.cluster_wait import wait_targets

if TYPE_CHECKING:
    from eventbus.publishing.slots import Slot


class Wire:
    """The batches of one publisher's sender, on `redis` (see the module docstring)."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._prefixes: dict[tuple[str | None, int], bytes] = {}  # (stream, cap) -> `_prefix`

    def pack(self, batch: list[Slot]) -> bytes:
        """The batch's XADDs (and WAIT), packed for one write (RESP, the bytes of hiredis's
        ``pack_command``).

        The common XADD (`encode_entry`'s three fields) is formatted from a prefix packed once
        per shard stream and cap (``XADD <stream> MAXLEN ~ <cap> * rid``) and its three values,
        one ``%`` per entry: hiredis's ``pack_command`` took ~10x as long for the 12 arguments.
        Any other field map goes through ``pack_command``."""
        # hiredis's stub types the argument as a 1-tuple; any tuple of str/bytes/int is packed
        pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)
        prefixes = self._prefixes
        packed = []
        for s in batch:  # `_xadd`'s common case inline (no call per slot)
            f = s.fields
            if f is not None and len(f) == 3 and F_DATA in f and F_RESOURCE in f and F_TYPE in f:
                prefix = prefixes.get((s.stream, s.maxlen)) or self._prefix(s)
                rid, etype, data = f[F_RESOURCE], f[F_TYPE], f[F_DATA]
                packed.append(_TAIL % (prefix, len(rid), rid, len(etype), etype, len(data), data))
            else:
                packed.append(pack(_xadd(s)))
        payload = b"".join(packed)
        replicas = self._settings.publish_replicas
        if replicas:
            payload += pack((b"WAIT", replicas, self._settings.publish_replicas_timeout_ms))
        return payload

    def _prefix(self, s: Slot) -> bytes:
        """The RESP of a 12-argument XADD up to its ``rid`` field name for `s`'s stream and
        cap, packed by hiredis (remembered; at most `_MAX_PREFIXES`, then made again)."""
        if len(self._prefixes) >= _MAX_PREFIXES:
            self._prefixes.clear()
        pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)
        head = pack((b"XADD", s.stream, b"MAXLEN", b"~", s.maxlen, b"*"))
        prefix: bytes = b"*12" + head[2:] + _RID
        self._prefixes[(s.stream, s.maxlen)] = prefix
        return prefix

    async def read(self, conn: Any, batch: list[Slot]) -> None:
        """Read the replies of `batch` (sent on `conn`) and settle its slots.

        Replies already in the connection's buffer are taken from its hiredis reader directly;
        only when the buffer runs dry does ``conn.read_response()`` (two coroutines, a timeout
        check and an error message built per call) read the socket. Both parse with the same
        reader, so the replies and their errors are the same either way."""
        results: list[Any] = []
        refused = 0
        gets = buffered_replies(conn)
        for _ in batch:
            reply = gets() if gets is not None else NOT_READ
            if reply is NOT_READ:
                try:
                    reply = await conn.read_response()
                except ResponseError as exc:  # this XADD failed; the rest of the replies follow
                    reply = exc
            elif isinstance(reply, Exception) and not isinstance(reply, ResponseError):
                raise reply  # e.g. a ConnectionError the reader made: as read_response raises
            if isinstance(reply, ResponseError):
                refused += 1
            results.append(reply)
        short = None
        if self._settings.publish_replicas:
            try:
                short = self._replicas_short(await conn.read_response())
            except ResponseError as exc:  # e.g. WAIT sent to a replica after a failover
                short = PublishError(f"WAIT failed: {exc}; the events are on the primary")
        for slot, result in zip(batch, results, strict=True):
            if short is None and type(result) is bytes:  # `Slot.settle` of an entry ID, inline
                if not slot.future.done():
                    slot.future.set_result(result.decode())
            else:
                slot.settle(short or result)
        observe_publish(batch, len(batch) if short else refused, self._settings.publish_timeout_s)

    async def send_packed_once(self, batch: list[Slot]) -> None:
        """Send `batch` on a pooled connection and read its replies (no flusher running)."""
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(self.pack(batch))
            await self.read(conn, batch)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def pipeline(self, batch: list[Slot]) -> None:
        """Send `batch` with redis-py's pipeline and settle its slots; raises the first lost
        reply (or other error) after settling what was confirmed.

        On a Cluster one pipeline per primary (as the client's slot table has it), one after
        the other. redis-py's cluster pipeline raises for the whole batch when one node's
        connection cannot be written (``asyncio.gather`` of its nodes), which left the other
        nodes' stored XADDs to be sent again: duplicates on every retry while a primary was
        down. Not at once either: after a connection error redis-py closes every connection of
        the client to refresh the topology (``RedisCluster.aclose``), and a sibling pipeline
        reading its replies at that moment would lose them (sent again: duplicates). Measured
        on a 3-primary loopback cluster: ``publish_many`` about 8 % slower, ``publish()`` calls
        and their latency unchanged (docs/operations.md)."""
        groups: dict[str, list[Slot]] = {}
        for s in batch:
            groups.setdefault(_node_name(self._redis, s.stream), []).append(s)
        errors: list[Exception] = []
        for group in groups.values():
            try:
                await self._pipeline_one(group)
            except Exception as exc:  # the other nodes' slots are still sent
                errors.append(exc)
        if errors:  # a lost reply first: those slots are sent again
            raise next((e for e in errors if isinstance(e, LOST_REPLY)), errors[0])

    async def _pipeline_one(self, batch: list[Slot]) -> None:
        """`pipeline` for the slots of one node (or of a client that is not a Cluster's)."""
        pipe = self._redis.pipeline(transaction=False)
        for s in batch:
            pipe.xadd(s.stream, s.fields, maxlen=s.maxlen, approximate=True)
        replicas = self._settings.publish_replicas
        waits = wait_targets(self._redis, [s.stream for s in batch]) if replicas else []
        timeout_ms = self._settings.publish_replicas_timeout_ms
        for target in waits:  # on a Cluster the node that took the XADDs (cluster_wait)
            pipe.execute_command("WAIT", replicas, timeout_ms, **target)
        results = await pipe.execute(raise_on_error=False)
        short = None
        for confirmed in [results.pop() for _ in waits]:
            short = short or (
                PublishError(f"WAIT failed: {confirmed}; the events are on the primary")
                if isinstance(confirmed, Exception)
                else self._replicas_short(confirmed)
            )
        # A lost reply leaves its stream's slots from there on unsettled, to be sent again in
        # order; the other streams' slots are settled, not sent twice.
        lost: Exception | None = None
        lost_streams: set[str | None] = set()
        for slot, result in zip(batch, results, strict=True):
            if isinstance(result, LOST_REPLY) or slot.stream in lost_streams:
                lost = lost or result
                lost_streams.add(slot.stream)
                continue
            slot.settle(short or result)
        if lost is not None:
            raise lost
        failed = len(batch) if short else sum(isinstance(r, Exception) for r in results)
        observe_publish(batch, failed, self._settings.publish_timeout_s)

    def _replicas_short(self, confirmed: Any) -> PublishError | None:
        """The error for a WAIT reply of `confirmed` replicas, or None if enough confirmed."""
        want = self._settings.publish_replicas
        if isinstance(confirmed, int) and confirmed >= want:
            return None
        return PublishError(
            f"only {confirmed} of {want} replicas confirmed within "
            f"{self._settings.publish_replicas_timeout_ms} ms (WAIT); the event is on the primary"
        )


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)  # a RESP bulk string


_RID = _bulk(F_RESOURCE)
_TAIL = b"%s$%d\r\n%s\r\n" + _bulk(F_TYPE) + b"$%d\r\n%s\r\n" + _bulk(F_DATA) + b"$%d\r\n%s\r\n"
"""An XADD's `_prefix`, then its three field values with the names of ``type`` and ``data``."""
_MAX_PREFIXES = 4096


def _xadd(s: Slot) -> tuple[Any, ...]:
    """The XADD of slot `s` as a command tuple: the three fields of `encode_entry` in their
    order without a loop (the common case), any other field map as it comes."""
    f = s.fields or {}
    if len(f) == 3 and F_DATA in f and F_RESOURCE in f and F_TYPE in f:
        return (b"XADD", s.stream, b"MAXLEN", b"~", s.maxlen, b"*",
                F_RESOURCE, f[F_RESOURCE], F_TYPE, f[F_TYPE], F_DATA, f[F_DATA])  # fmt: skip
    return (
        b"XADD",
        s.stream,
        b"MAXLEN",
        b"~",
        s.maxlen,
        b"*",
        *[x for kv in f.items() for x in kv],
    )


def _node_name(redis: Any, stream: str | None) -> str:
    """The name of the primary serving `stream` in a Cluster client's slot table; "" for any
    other client (one pipeline)."""
    if stream is None or not hasattr(redis, "get_node_from_key"):
        return ""
    try:
        return str(redis.get_node_from_key(stream).name)
    except Exception:  # slot table being rebuilt: the pipeline routes (or raises) by itself
        return ""
