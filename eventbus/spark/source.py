"""``spark.read.format("eventbus")``: a topic's archived segments (and Redis tail) as a DataFrame.

One Spark task per segment (small segments of a shard packed up to ``packBytes``), rows in
entry-ID order inside a task; with ``redis_url`` one more task per shard reads the entries after
the offloader's checkpoint with ``XRANGE`` (`eventbus.spark.planning` explains the cut). Tasks
yield Arrow record batches. `EventbusSource` is also the streaming source
(`eventbus.spark.stream`) and the writer (`eventbus.spark.writer`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    Filter,
    InputPartition,
)
from pyspark.sql.types import StructType

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO
from eventbus.spark.objects import Objects, as_objects
from eventbus.spark.options import SourceOptions
from eventbus.spark.planning import (
    Cut,
    RangePart,
    SegmentsPart,
    parse_ranges,
    plan_topics,
    surface,
)
from eventbus.spark.pruning import Pruning
from eventbus.spark.schema import CORRUPT, gaps_schema, read_schema
from eventbus.tier.errors import CorruptSegment

log = logging.getLogger("eventbus.spark")


class EventbusSource(DataSource):
    """The ``eventbus`` data source. Options: see docs/spark.md (`SourceOptions`)."""

    @classmethod
    def name(cls) -> str:
        return "eventbus"

    def _opts(self, need_store: bool = True) -> SourceOptions:
        # the models are imported where used: `schema` (at load()), the writer (at save()), the
        # tasks; a stream's planner process never imports them (nor pydantic, the codec)
        return SourceOptions.parse(self.options, need_store=need_store, load_model=False)

    def schema(self) -> StructType:
        opts = self._opts()
        models = opts.models()  # a bad model fails at load(), whichever table
        if opts.table == "gaps":
            return gaps_schema()
        if opts.plan:
            from eventbus.spark.stream import PLAN

            return PLAN
        return read_schema(models)

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = self._opts()
        if opts.plan:  # set by `read_stream` on its planning stream, never a batch read's
            raise ConfigError(
                "option _plan is internal to eventbus.spark.read_stream (a stream's micro-batch "
                "plan): a batch read does not take it"
            )
        if opts.table == "gaps":
            return GapsReader(opts)
        if not opts.pushdown:
            return BatchReader(opts, schema)
        return PruningReader(opts, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from eventbus.spark.stream import StreamReader

        opts = self._opts()
        try:
            return StreamReader(opts, schema)
        except ConfigError as exc:  # raised at the reader's first call (see `Refused`)
            return Refused(exc)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from eventbus.spark.writer import EventWriter

        if overwrite:  # Kafka's sink refuses it too: published events cannot be replaced
            raise ConfigError(
                'mode("overwrite") cannot replace published events: the writer appends '
                '(mode("append"))'
            )
        return EventWriter(self._opts(need_store=False), schema)


class BatchReader(DataSourceReader):
    """Plans on the driver (`partitions`), reads in tasks (`read`)."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        self.opts = opts
        self.schema = schema
        self.pruning = Pruning()

    def plan(self) -> dict[str, Cut]:
        """The cut of each subscribed topic (``subscribe``, else ``topic``): `plan_topics`."""
        return plan_topics(as_objects(self.opts.open_store(entries=False)), self.opts, self.pruning)

    def partitions(self) -> Sequence[InputPartition]:
        if self.opts.ranges is not None:  # the tail of a cut `eventbus.spark.native` planned
            return parse_ranges(self.opts.ranges) or [SegmentsPart((), ZERO, ZERO)]
        cuts = self.plan()
        surface(cuts, self.opts.on_gap)
        parts = [p for cut in cuts.values() for p in cut.parts]
        return parts or [SegmentsPart((), self.pruning.lo, self.pruning.hi)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # here, not at the top: they import the tier's segment codec (and pandas), which the
        # writer's and the driver's Python processes that unpickle this source never need
        from eventbus.spark.decode import Converter
        from eventbus.spark.reading import converted_range, id_mask, segment_batches, stats_exclude

        opts = self.opts
        objects = as_objects(opts.open_store())
        conv = Converter.of(opts, self.schema)
        if isinstance(partition, RangePart):  # (no redis_url: segments the native path hands us)
            yield from converted_range(opts, objects, partition, conv)
            return
        assert isinstance(partition, SegmentsPart)
        for i, ref in enumerate(partition.refs):
            if stats_exclude(objects, ref, partition.time_lo, partition.time_hi):
                continue
            # rows below the part's range (startingOffsets, pruning) or given by an earlier,
            # overlapping segment; rows above it (endingOffsets, pruning)
            lows = [partition.floor(i), partition.lo.prev() if partition.lo > ZERO else None]
            floor = max((x for x in lows if x is not None), default=None)
            floor = floor if floor is not None and ref.first <= floor else None
            ceiling = partition.hi if ref.last > partition.hi else None
            try:
                batches = segment_batches(objects, ref, conv.read_typing)
            except CorruptSegment as exc:
                if opts.mode == "FAILFAST":
                    raise
                log.error("%s (mode PERMISSIVE: one _corrupt row stands for it)", exc)
                yield corrupt_row(conv.target, ref, str(exc))
                continue
            for batch in batches:
                if floor is not None or ceiling is not None:
                    batch = batch.filter(id_mask(batch, floor, ceiling))
                yield conv.convert(batch)


class PruningReader(BatchReader):
    """`BatchReader` with filter pushdown (``spark.sql.python.filterPushdown.enabled``, which
    `eventbus.spark.register` turns on): pushed filters prune shards and segments, and are all
    handed back to Spark to filter the rows."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        self.pruning = Pruning.from_filters(filters)
        yield from filters


def corrupt_row(target: pa.Schema, ref: Any, reason: str) -> pa.RecordBatch:
    """One row naming a corrupt segment: topic, shard and ``_corrupt`` set, the rest null."""
    values = {"topic": ref.topic, "shard": ref.shard, CORRUPT: reason}
    arrays = [pa.array([values.get(f.name)], f.type) for f in target]
    return pa.RecordBatch.from_arrays(arrays, schema=target)


class GapsReader(DataSourceReader):
    """The side table of gap records (``option("table", "gaps")``), one task."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        objects: Objects = as_objects(self.opts.open_store(entries=False))
        for topic in self.opts.subscribed or (self.opts.topic,):
            yield from self._gaps(objects, topic)

    def _gaps(self, objects: Objects, topic: str) -> Iterator[tuple[Any, ...]]:
        for shard in objects.shards(topic):
            for g in objects.gaps(topic, shard):
                yield tuple(
                    g.get(name) if name != "shard" else int(g.get("shard", shard))
                    for name in gaps_schema().fieldNames()
                )


class Refused(DataSourceStreamReader):
    """The stream reader of a stream whose options a stream cannot take: it raises the
    `ConfigError` at its first call. (Raised from ``streamReader`` itself, PySpark 4.1's
    runner reported its own ``UnboundLocalError`` with ours chained under it.)"""

    def __init__(self, error: ConfigError) -> None:
        self.error = error

    def initialOffset(self) -> dict[str, Any]:
        raise self.error

    def latestOffset(self, *args: Any) -> dict[str, Any]:
        raise self.error

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        raise self.error

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        raise self.error
