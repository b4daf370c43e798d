"""``spark.readStream.format("eventbus")``: topics as a stream, archive first, then Redis.

**Offsets** are JSON objects ``{"<topic>": {"<shard>": "<ms>-<seq>"}}``, as Kafka's
(`eventbus.spark.offsets`): per subscribed topic (``subscribe``, several comma-separated, or
``topic``), per shard, the last entry ID read (``"0-0"``: nothing yet). A micro-batch (start,
end] reads, per topic and shard, the segments up to the offloader's checkpoint, then ``XRANGE``
after it, with the re-check of `eventbus.spark.reading.read_range`: a query that fell behind
Redis's trim point continues from the archive with no gap. A checkpoint written for another
topic set is refused.
Entries are immutable, so re-running a batch after a restart gives the same rows: Spark's
checkpoint makes delivery into exactly-once sinks exactly-once.

Options: ``startingOffsets`` = ``earliest`` (default) | ``latest`` | a JSON offset keyed by topic
as Kafka's (``{"orders": {"0": "..."}}``, naming every subscribed topic; shards left out start
at the beginning), or per shard only for one topic | a time (Unix ms, or ISO-8601; UTC when no
offset is given: the first entries added at or after it); ``maxOffsetsPerTrigger`` (alias
``maxEntriesPerTrigger``) caps a micro-batch, split over every topic's shards that have new
entries in proportion to their lag, as Kafka's source splits it over partitions
(`eventbus.spark.offsets.share`, lags counted by `eventbus.spark.backlog`); ``failOnDataLoss``
is checked per topic.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StringType, StructField, StructType

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.spark.backlog import Backlog, Span
from eventbus.spark.objects import Objects, as_objects
from eventbus.spark.offsets import (
    Offset,
    Offsets,
    by_topic,
    initial_offset,
    parse_start,
    share,
    starts_beyond,
)
from eventbus.spark.options import SourceOptions
from eventbus.spark.planning import (
    RangePart,
    archived_upto,
    checkpoints,
    last_ids,
    shard_count,
    unknown_topic,
)
from eventbus.spark.surfacing import lost_in, surface_gaps, surface_loss
from eventbus.tier.layout import SegmentRef

__all__ = ["PLAN", "Offset", "Offsets", "StreamReader", "parse_start"]

log = logging.getLogger("eventbus.spark")

# option ``_plan`` (`eventbus.spark.native_stream`): one row per micro-batch, its offsets as JSON
PLAN = StructType([StructField("start", StringType()), StructField("end", StringType())])


@dataclass(frozen=True)
class PlanPart(InputPartition):
    """A micro-batch of a ``_plan`` stream: its start and end offsets (`Offsets` as JSON)."""

    start: str
    end: str


@dataclass
class _Heads:
    """What the driver sees now, per topic and shard: the offloader's checkpoints (or where
    the archive ends, when later) and the last readable entry. `redis` is open: close it."""

    objects: Objects
    redis: Any
    cps: dict[str, dict[int, EntryId]] = field(default_factory=dict)
    heads: dict[str, dict[int, EntryId]] = field(default_factory=dict)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches on the driver, reads them in tasks (one per topic and shard with new
    entries).

    ``Trigger.AvailableNow``: the entries present when the query starts are read, in
    micro-batches of at most ``maxOffsetsPerTrigger``, then the query stops. The streaming
    progress reports, as ``latestOffset``, the last entry of each topic's shards now readable (a
    query's lag is its end offset against it)."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        if opts.ending_offsets.strip().lower() != "latest":  # as Kafka's source: not ignored
            raise ConfigError("option endingOffsets is for batch reads: a stream has no end")
        self.opts = opts
        self.schema = schema
        self.topics: tuple[str, ...] = opts.subscribed or (opts.topic,)
        text = opts.starting_offsets
        if opts.starting_timestamp is not None:  # Kafka's name for a time start
            text = str(opts.starting_timestamp)
        self.start = {t: parse_start(text, t, self.topics) for t in self.topics}
        self.target: dict[str, dict[int, EntryId]] | None = None  # AvailableNow: where to stop
        self.latest: Offsets | None = None  # for reportLatestOffset
        self._listed: dict[tuple[str, int], list[SegmentRef]] = {}  # segments seen so far
        self._backlog = Backlog()  # segments' entry counts seen so far

    def __getstate__(self) -> dict[str, Any]:  # tasks get the reader without the listing cache
        state = dict(self.__dict__)
        state["_listed"] = {}
        state["_backlog"] = Backlog()
        return state

    def _segments(self, objects: Objects, topic: str, shard: int) -> list[SegmentRef]:
        """The shard's segments, listing only the keys after the last one seen (segments are
        immutable and a new one's key sorts after the known ones: no full listing per batch)."""
        known = self._listed.setdefault((topic, shard), [])
        known += objects.segments(topic, shard, after=known[-1] if known else None)
        return known

    def prepareForTriggerAvailableNow(self) -> None:
        now = self._heads()
        now.close()
        self.target = now.heads

    def reportLatestOffset(self) -> Offsets | None:
        return self.latest

    # Spark sees offsets keyed by topic, as Kafka's ({"orders": {"0": "<entry ID>"}}); they are
    # per shard inside. A checkpoint of another topic set is refused; an older one-topic
    # checkpoint's offsets, per shard only, are taken as they are (`by_topic`).
    def initialOffset(self) -> Offsets:
        """Where a new query starts; raises `ConfigError` for a topic with no shard in the
        archive or in Redis (a misspelled topic must not stream nothing, for ever)."""
        now = self._heads()
        try:
            for t in self.topics:
                if not now.heads[t]:
                    raise unknown_topic(t, now.objects, now.redis)
                if now.redis is not None:  # (without Redis the archive may lag the offsets)
                    beyond = starts_beyond(self.start[t], now.heads[t])
                    if beyond:  # as replay's ArchiveGap: else entries added before are skipped
                        surface_loss(t, beyond, self.opts.on_gap or "fail")
        finally:
            now.close()
        return {t: initial_offset(self.start[t], now.heads[t]) for t in self.topics}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> Offsets:
        return self._latest_offset(by_topic(start, self.topics), limit)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, upto = by_topic(start, self.topics), by_topic(end, self.topics)
        objects = as_objects(self.opts.open_store(entries=False))
        redis = self.opts.redis()
        try:
            parts: list[InputPartition] = []
            for t in self.topics:  # (also `_plan`'s: its gap checks, as failOnDataLoss says)
                parts += self._partitions(objects, redis, t, begin[t], upto[t])
            if self.opts.plan:  # the batch's bounds, read natively by `native_stream`
                return [PlanPart(json.dumps(begin), json.dumps(upto))] if parts else []
            return parts
        finally:
            if redis is not None:
                redis.close()

    # -- driver side --------------------------------------------------------------------------
    def _shards(self, objects: Objects, redis: Any, topic: str) -> list[int]:
        count = shard_count(redis, self.opts.keys(), topic, self.opts.shards)
        return sorted(set(objects.shards(topic)) | set(range(count or 0)))

    def _heads(self) -> _Heads:
        """Per topic and shard: the checkpoint (where the archive ends) and the last entry now
        readable."""
        now = _Heads(as_objects(self.opts.open_store(entries=False)), self.opts.redis())
        try:
            for t in self.topics:
                now.cps[t], now.heads[t] = self._topic_heads(now.objects, now.redis, t)
        except BaseException:
            now.close()
            raise
        return now

    def _topic_heads(
        self, objects: Objects, redis: Any, topic: str
    ) -> tuple[dict[int, EntryId], dict[int, EntryId]]:
        shards = self._shards(objects, redis, topic)
        keys = self.opts.keys()
        cps = checkpoints(redis, keys, topic, shards) if redis is not None else {}
        heads: dict[int, EntryId] = {}
        for s in shards:
            refs = self._segments(objects, topic, s)
            if redis is not None:
                upto = archived_upto(cps.get(s), refs)
                if upto is not None:
                    cps[s] = upto  # where the archive ends, for `Backlog.nth`
            heads[s] = max([refs[-1].last] if refs else [], default=ZERO)
            if s in cps:
                heads[s] = max(heads[s], cps[s])
        if redis is not None:
            for s, last in last_ids(redis, keys, topic, shards).items():
                heads[s] = max(heads.get(s, ZERO), last)
        return cps, heads

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_entries_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def _latest_offset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        now = self._heads()
        try:
            self.latest = {
                t: {str(s): str(h) for s, h in heads.items()} for t, heads in now.heads.items()
            }
            heads = now.heads
            if self.target is not None:  # nothing added after the AvailableNow query started
                target = self.target
                heads = {
                    t: {s: min(h, target.get(t, {}).get(s, ZERO)) for s, h in hs.items()}
                    for t, hs in heads.items()
                }
            end = {t: self._forward(t, start[t], heads[t], now.redis) for t in self.topics}
            if not isinstance(limit, ReadMaxRows):
                return end
            # the limit over every topic's shards with new entries, in proportion to their lag
            # (as Kafka's source), least advanced first
            behind = sorted(
                (parse_id(start[t].get(k, "0-0")), t, int(k))
                for t in self.topics
                for k in end[t]
                if parse_id(end[t][k]) > parse_id(start[t].get(k, "0-0"))
            )
            spans = [
                Span(
                    now.objects,
                    now.redis,
                    self.opts.keys().stream(t, s),
                    self._segments(now.objects, t, s),
                    after,
                    heads[t][s],
                    now.cps[t].get(s),
                )
                for after, t, s in behind
            ]
            lags = [self._backlog.lag(*span) for span in spans]
            quotas = share(limit.max_rows, lags)
            for span, (after, t, s), quota in zip(spans, behind, quotas, strict=True):
                cut = self._backlog.nth(span, quota) if quota else after
                end[t][str(s)] = str(min(cut, heads[t][s]))  # (AvailableNow: not past its target)
            return end
        finally:
            now.close()

    def _forward(self, topic: str, start: Offset, heads: dict[int, EntryId], redis: Any) -> Offset:
        """The end offset of `topic` at `heads`, never before `start` (a shard's stream deleted):
        offsets past the archive's and the stream's last entries fail (failOnDataLoss) or warn."""
        end = {str(s): str(h) for s, h in heads.items()}
        beyond = []
        for key, was in start.items():
            if parse_id(end.get(key, "0-0")) < parse_id(was):
                beyond.append(f"shard {key} at {was}, last entry {end.get(key, 'none')}")
                end[key] = was
        if beyond and redis is not None:  # as replay's ArchiveGap: else a silent hole
            # (without Redis the archive may just not have caught up with the offsets yet)
            surface_loss(topic, beyond, self.opts.on_gap or "fail")
        return end

    def _partitions(
        self, objects: Objects, redis: Any, topic: str, start: Offset, end: Offset
    ) -> list[InputPartition]:
        shards = sorted(int(s) for s in end)
        cps = checkpoints(redis, self.opts.keys(), topic, shards) if redis is not None else {}
        parts: list[InputPartition] = []
        lost: list[dict[str, Any]] = []
        for s in shards:
            after = parse_id(start.get(str(s), "0-0"))
            upto = parse_id(end[str(s)])
            if upto <= after:
                continue
            listed = self._segments(objects, topic, s)
            if redis is not None:
                cp = archived_upto(cps.get(s), listed)
            else:  # the archive is all there is: a segment the range ends inside is read too
                cp = max(upto, listed[-1].last) if listed else upto  # (it was `upto`: skipped)
            refs = tuple(
                r
                for r in listed
                if r.last > after and r.first <= upto and (cp is not None and r.last <= cp)
            )
            parts.append(RangePart(topic, s, None if after == ZERO else after, upto, cp, refs))
            lost += [g for g in objects.gaps(topic, s) if lost_in(g, after, upto)]
        # Kafka's failOnDataLoss, default true: entries lost in this batch's range fail it
        surface_gaps(topic, lost, self.opts.on_gap or "fail")
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: offsets live in Spark's checkpoint, entries stay where they are."""

    # -- task side ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[Any]:
        if isinstance(partition, PlanPart):
            yield (partition.start, partition.end)
            return
        assert isinstance(partition, RangePart)
        # here, not at the top: the tier's segment codec (and pandas) is the tasks' alone; the
        # driver's stream process (offsets, planning) starts without it
        from eventbus.spark.decode import Converter
        from eventbus.spark.reading import converted_range

        objects = as_objects(self.opts.open_store())
        yield from converted_range(
            self.opts, objects, partition, Converter.of(self.opts, self.schema)
        )
