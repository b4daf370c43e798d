"""``df.write.format("eventbus")``: publish DataFrame rows as events (backfill).

Each Spark task publishes its partition's rows **in row order** through the normal publisher
(`eventbus.publishing.publisher.Publisher.publish_envelopes`: shard hash, ``MAXLEN ~``, size
limit, coalesced pipelines) with one pipeline in flight at a time, so the XADDs reach Redis in row
order. Sort within partitions (``df.repartition("plane").sortWithinPartitions("position")``) to
fix each resource's order. Rows go in chunks of `CHUNK`, one ``publish_envelopes`` call each:
a chunk is validated, encoded and size-checked whole before any of it is sent, so a bad row
fails the task with nothing of its chunk published (earlier chunks stay published).

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

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from eventbus.config import Settings
from eventbus.errors import ConfigError
from eventbus.protocol.codec import Envelope, event_type_of
from eventbus.protocol.event_ids import new_event_id
from eventbus.spark.options import SourceOptions

log = logging.getLogger("eventbus.spark")

NAMESPACE = uuid.UUID("6f0e7c52-8d0f-4b59-9a57-3c1f1e0b5e11")
"""Namespace of the UUID version 5 event IDs derived from ``event_id_col``."""

CHUNK = 5000
"""Rows per `Publisher.publish_envelopes` call (per Arrow slice turned into Python rows)."""


def derived_event_id(topic: str, key: Any) -> bytes:
    """The 16-byte event ID of the row whose ``event_id_col`` is `key`: UUID version 5 of
    ``"<topic>/<key>"`` (`uuid.uuid5`, RFC 9562), so the same row always gets the same ID.
    Raises `ConfigError` for a null key: every such row would get one ID, and a subscriber's
    de-duplication window would drop all of them but the first."""
    if key is None:
        raise ConfigError("a row has no event ID key (null in event_id_col)")
    return uuid.uuid5(NAMESPACE, f"{topic}/{key}").bytes


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
        self, rows: list[dict[str, Any]], adapter: TypeAdapter[Any] | None, etype: str
    ) -> list[Envelope]:
        """Envelopes for `rows` (one Arrow batch). With a model the rows are validated and dumped
        in one call each. Raises `ConfigError` for a row that does not validate or has no
        resource ID (nothing of this batch is published then)."""
        opts = self.opts
        hcol, rcol, kcol = opts.headers_col, opts.resource_id_col or "", opts.event_id_col
        headers = [r.pop(hcol, None) for r in rows] if hcol else [None] * len(rows)
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
        now = time.time_ns() // 1_000_000
        out = []
        for values, payload, h in zip(rows, payloads, headers, strict=True):
            rid = values.get(rcol)
            if rid is None or rid == "":
                raise ConfigError(f"row without a resource ID in column {rcol!r}: {values}")
            eid = derived_event_id(opts.topic, values[kcol]) if kcol else new_event_id()
            env = Envelope(
                resource_id=str(rid),
                event_type=etype,
                event_id_bytes=eid,
                published_at_ms=now,
                headers=dict(h) if h else {},
                payload=payload,
            )
            out.append(env)
        return out

    async def _publish(self, iterator: Iterator[Any]) -> int:
        from eventbus.app import EventBus

        opts = self.opts
        settings = Settings(
            redis_url=opts.redis_url,
            key_prefix=opts.key_prefix,
            hashtag=opts.hashtag,
            publish_pipelines=1,  # one pipeline in flight: XADDs land in call (row) order
        )
        bus = EventBus(settings)
        models = opts.models()
        model = models[None] if models else None
        adapter = TypeAdapter(list[model]) if model else None  # type: ignore[valid-type]
        etype = event_type_of(model) if model else opts.event_type or ""
        count = 0
        try:
            async with bus:
                stored = await bus.redis.hget(bus.keys.topics(), opts.topic)
                shards = opts.shards or (int(stored) if stored else settings.shards)
                topic = bus.topic(opts.topic, shards=shards)
                await bus.registry.ensure(topic)  # checked once, before any row is queued
                for batch in iterator:
                    for i in range(0, batch.num_rows, CHUNK):
                        rows = batch.slice(i, CHUNK).to_pylist()
                        envelopes = self._envelopes(rows, adapter, etype)
                        count += len(await bus.publisher.publish_envelopes(topic, envelopes))
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
