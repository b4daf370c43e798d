"""``df.write.format("eventbus")``: publish DataFrame rows as events (backfill).

Each Spark task publishes its partition's rows **in row order** through the normal publisher
(`eventbus.publishing.publisher.Publisher.publish_envelopes`: shard hash, ``MAXLEN ~``, size
limit, coalesced pipelines over one connection), so the XADDs reach Redis in row order. Sort
within partitions (``df.repartition("plane").sortWithinPartitions("position")``) to fix each
resource's order. Rows go in chunks of `CHUNK`, one ``publish_envelopes`` call each:
a chunk is validated, encoded and size-checked whole before any of it is sent, so a bad row
fails the task with nothing of its chunk published (earlier chunks stay published).

Envelopes are built per Arrow slice, column by column. With a model of plain typed fields
(`typed_payloads`) the payloads are read from the columns when they have the fields' types, no
pydantic model per row; other batches and models are validated by pydantic.

Options: ``topic``, ``redis_url``, ``resource_id_col`` (required); ``model`` (rows validated into
it: payload ``model_dump(mode="json")``, type ``__event_type__`` or the class name) or
``event_type`` (payload: the row's columns as JSON-compatible values); ``event_id_col``: event
IDs derived from that column (UUID version 5 of topic and key), so that a retried task publishes
the same event IDs; ``headers_col`` (a map column); ``shards``, ``key_prefix``, ``hashtag``.

**At-least-once.** A task that fails after some XADDs is retried by Spark and publishes its
rows again: duplicates with the same event IDs (with ``event_id_col``), which a subscriber
skips with ``@bus.subscriber(..., dedup_window_s=...)``. Without ``event_id_col`` the copies
are different events.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from eventbus.config import Settings
from eventbus.errors import ConfigError
from eventbus.protocol.codec import Envelope, event_type_of
from eventbus.protocol.event_ids import new_event_id
from eventbus.spark.options import SourceOptions
from eventbus.spark.payloads import plain_fields, typed_payloads

log = logging.getLogger("eventbus.spark")

NAMESPACE = uuid.UUID("6f0e7c52-8d0f-4b59-9a57-3c1f1e0b5e11")
"""Namespace of the UUID version 5 event IDs derived from ``event_id_col``."""

CHUNK = 5000
"""Rows per `Publisher.publish_envelopes` call (one Arrow slice's envelopes)."""

PIPELINES = 8
"""The writer's ``publish_pipelines``: its pipelines (``publish_batch_max``, 1,000 XADDs) in
flight at once, more than a chunk's, so that a whole chunk is with Redis while the next is built
(the default, 2, left Redis idle while this process built the next chunk)."""


_NAMESPACE_SHA1 = hashlib.sha1(NAMESPACE.bytes, usedforsecurity=False)


def derived_event_id(topic: str, key: Any) -> bytes:
    """The 16-byte event ID of the row whose ``event_id_col`` is `key`: UUID version 5 of
    ``"<topic>/<key>"`` (`uuid.uuid5`, RFC 9562), so the same row always gets the same ID.
    Raises `ConfigError` for a null key: every such row would get one ID, and a subscriber's
    de-duplication window would drop all of them but the first.

    Computed as `uuid.uuid5` does (SHA-1 of namespace and name, version and variant bits set)
    without its `uuid.UUID` objects: a third of its cost, once per row."""
    if key is None:
        raise ConfigError("a row has no event ID key (null in event_id_col)")
    h = _NAMESPACE_SHA1.copy()
    h.update(f"{topic}/{key}".encode())
    b = bytearray(h.digest()[:16])
    b[6] = (b[6] & 0x0F) | 0x50  # version 5
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 9562 variant
    return bytes(b)


def derived_event_ids(topic: str, keys: list[Any]) -> list[bytes]:
    """`derived_event_id` of each key, in order (one Arrow batch's ``event_id_col``); raises
    its `ConfigError` for a null key."""
    if None in keys:
        raise ConfigError("a row has no event ID key (null in event_id_col)")
    sha1, out = _NAMESPACE_SHA1.copy, []
    for key in keys:
        h = sha1()
        h.update(f"{topic}/{key}".encode())
        b = bytearray(h.digest()[:16])
        b[6] = (b[6] & 0x0F) | 0x50
        b[8] = (b[8] & 0x3F) | 0x80
        out.append(bytes(b))
    return out


async def _publish_overlapped(
    publish: Callable[[Any, list[Envelope]], Awaitable[list[str]]],
    topic: Any,
    chunks: Iterator[list[Envelope]],
) -> int:
    """Publish each chunk of `chunks` with ``publish(topic, chunk)`` (`Publisher.
    publish_envelopes`), in order, the next chunk built (Arrow to envelopes, in this process)
    while the previous one's XADDs are with Redis (at most two chunks sent and unconfirmed), so
    Redis and this process work at once instead of in turn. Returns the envelopes published.

    Call order is publish order: each call's task reserves its places before its first await,
    and asyncio starts the tasks in the order they were made, chunk order. A chunk that cannot
    be built or published raises after the chunk in flight settled (its rows stay published;
    its own error, if any, is logged), so that no XADD is left unconfirmed when the task
    fails."""
    count = 0
    sent: list[asyncio.Future[list[str]]] = []  # the chunk in flight, then the one just sent
    try:
        for chunk in chunks:
            sent.append(asyncio.ensure_future(publish(topic, chunk)))
            if len(sent) == 2:
                count += len(await sent.pop(0))
        if sent:
            count += len(await sent.pop())
    except BaseException:
        for task in sent:  # not yet awaited: let it settle, say how
            await asyncio.wait((task,))
            if not task.cancelled() and task.exception() is not None:
                log.error("a chunk in flight failed too: %s", task.exception())
        raise
    return count


@dataclass
class Published(WriterCommitMessage):
    """What one task published: rows and seconds."""

    rows: int
    seconds: float


class EventWriter(DataSourceArrowWriter):
    """Publishes each partition's rows in order (see the module docstring); rows arrive as
    Arrow record batches."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        if not opts.redis_url:
            raise ConfigError("option redis_url is required to write events")
        if not opts.resource_id_col:
            raise ConfigError("option resource_id_col is required: the column of resource IDs")
        names = schema.fieldNames()
        for option, col in (
            ("resource_id_col", opts.resource_id_col),
            ("event_id_col", opts.event_id_col),
            ("headers_col", opts.headers_col),
        ):
            if col is not None and col not in names:
                raise ConfigError(f"option {option}: no column {col!r} in {names}")
        models = opts.models()
        if models and None not in models:
            raise ConfigError("the writer takes one model (model='pkg.mod:Model'), not a map")
        if not models and not opts.event_type:
            raise ConfigError("the writer needs option model or option event_type")
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> Published:
        started = time.perf_counter()
        rows = anyio.run(self._publish, iterator)
        return Published(rows, time.perf_counter() - started)

    def _envelopes(
        self,
        batch: pa.RecordBatch,
        adapter: TypeAdapter[Any] | None,
        fields: dict[str, tuple[type, bool, Any]] | None,
        etype: str,
    ) -> list[Envelope]:
        """Envelopes for the rows of `batch` (a slice of one Arrow batch), built column by
        column. With a model whose fields are plain typed columns (`typed_payloads`) the payloads
        are read from the columns; otherwise the rows are validated and dumped by pydantic in one
        call each. Raises `ConfigError` for a row that does not validate or has no resource ID
        (nothing of this batch is published then)."""
        opts = self.opts
        hcol, rcol, kcol = opts.headers_col, opts.resource_id_col or "", opts.event_id_col
        payloads = typed_payloads(batch, fields) if fields is not None else None
        if payloads is None:
            rows = batch.to_pylist()
            if hcol:
                for r in rows:
                    r.pop(hcol, None)
            if adapter is not None:
                try:
                    payloads = adapter.dump_python(adapter.validate_python(rows), mode="json")
                except ValidationError as exc:
                    err = exc.errors()[0]
                    raise ConfigError(
                        f"row {err['loc'][0]} of a partition does not validate as {etype}: "
                        f"{'.'.join(map(str, err['loc'][1:]))}: {err['msg']}"
                    ) from None
            else:
                payloads = to_jsonable_python(rows)
        n = batch.num_rows
        rid_col = batch.column(rcol)
        text = pa.types.is_string(rid_col.type) or pa.types.is_large_string(rid_col.type)
        if rid_col.null_count or (text and pc.any(pc.equal(rid_col, "")).as_py()):
            i = next(i for i, r in enumerate(rid_col.to_pylist()) if r is None or r == "")
            row = batch.slice(i, 1).to_pylist()[0]
            raise ConfigError(f"row without a resource ID in column {rcol!r}: {row}")
        rids = rid_col.to_pylist() if text else [str(r) for r in rid_col.to_pylist()]
        if hcol:
            headers = [dict(h) if h else {} for h in batch.column(hcol).to_pylist()]
        else:
            headers = [{} for _ in range(n)]
        eids = (
            derived_event_ids(opts.topic, batch.column(kcol).to_pylist())
            if kcol
            else [new_event_id() for _ in range(n)]
        )
        now = time.time_ns() // 1_000_000
        return [
            Envelope(rid, etype, eid, now, h, payload)
            for rid, payload, h, eid in zip(rids, payloads, headers, eids, strict=True)
        ]

    async def _publish(self, iterator: Iterator[Any]) -> int:
        from eventbus.app import EventBus  # here: the driver's writer never needs the bus

        opts = self.opts
        # pipelines go over one connection in call order (`eventbus.publishing.sending`); a
        # whole chunk on the wire at once, so that Redis works through it while the next one is
        # built (`_publish_overlapped`)
        settings = Settings(
            redis_url=opts.redis_url,
            key_prefix=opts.key_prefix,
            hashtag=opts.hashtag,
            publish_pipelines=PIPELINES,
        )
        bus = EventBus(settings)
        models = opts.models()
        model = models[None] if models else None
        adapter = TypeAdapter(list[model]) if model else None  # type: ignore[valid-type]
        etype = event_type_of(model) if model else opts.event_type or ""
        fields = plain_fields(model) if model else None
        try:
            async with bus:
                stored = await bus.redis.hget(bus.keys.topics(), opts.topic)
                shards = opts.shards or (int(stored) if stored else settings.shards)
                topic = bus.topic(opts.topic, shards=shards)
                await bus.registry.ensure(topic)  # checked once, before any row is queued
                chunks = (
                    self._envelopes(batch.slice(i, CHUNK), adapter, fields, etype)
                    for batch in iterator
                    for i in range(0, batch.num_rows, CHUNK)
                )
                count = await _publish_overlapped(bus.publisher.publish_envelopes, topic, chunks)
        finally:
            await bus.aclose()
        return count

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, Published)]
        log.info("published %d rows to topic %s", sum(m.rows for m in done), self.opts.topic)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = sum(m.rows for m in messages if isinstance(m, Published))
        log.error(
            "write to topic %s failed; %d rows of finished tasks stay published (events are "
            "not retracted)",
            self.opts.topic,
            done,
        )
