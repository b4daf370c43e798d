"""``spark.readStream.format("eventbus")``: a topic as a stream, archive first, then Redis.

**Offsets** are JSON objects ``{"<topic>": {"<shard>": "<ms>-<seq>"}}``, as Kafka's: per shard,
the last entry ID read (``"0-0"``: nothing yet). A micro-batch (start, end] reads, per shard,
the segments up to the offloader's checkpoint, then ``XRANGE`` after it, with the re-check of
`eventbus.spark.reading.read_range`: a query that fell behind Redis's trim point continues from
the archive with no gap.
Entries are immutable, so re-running a batch after a restart gives the same rows: Spark's
checkpoint makes delivery into exactly-once sinks exactly-once.

Options: ``startingOffsets`` = ``earliest`` (default) | ``latest`` | a JSON offset (shards left
out start at the beginning), also keyed by topic as Kafka's (``{"orders": {"0": "..."}}``) | a
time (Unix ms, or ISO-8601; UTC when no offset is given: the first entries added at or after
it); ``maxOffsetsPerTrigger`` (alias ``maxEntriesPerTrigger``) caps a micro-batch (split evenly
over the shards that have entries, at least one entry per such shard).
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.spark.decode import Converter
from eventbus.spark.objects import Objects, as_objects
from eventbus.spark.options import SourceOptions
from eventbus.spark.planning import (
    RangePart,
    archived_upto,
    checkpoints,
    last_ids,
    shard_count,
    surface_gaps,
)
from eventbus.spark.reading import parquet_footer, read_range
from eventbus.spark.schema import arrow_schema
from eventbus.tier.errors import TierError
from eventbus.tier.layout import SegmentRef

Offset = dict[str, str]
log = logging.getLogger("eventbus.spark")


def parse_start(text: str, topic: str | None = None) -> str | dict[str, str] | int:
    """``earliest``/``latest``, a JSON offset (``{"<shard>": "<entry ID>"}``, or Kafka's form
    keyed by topic, ``{"<topic>": {"<shard>": "<entry ID>"}}``, which must name `topic`), or a
    time as Unix ms. Raises `ConfigError`."""
    value = text.strip()
    if value.lower() in ("earliest", "latest"):
        return value.lower()
    if value.startswith("{"):
        try:
            raw = json.loads(value)
            if raw and all(isinstance(v, dict) for v in raw.values()):
                if topic not in raw:
                    raise ConfigError(f"it names topics {sorted(raw)}, not {topic!r}")
                raw = raw[topic]
            return {str(int(k)): str(parse_id(str(v))) for k, v in raw.items()}
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"option startingOffsets: bad JSON offset {value!r}: {exc}") from None
    if value.isdigit():
        return int(value)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            "option startingOffsets must be earliest, latest, a JSON offset "
            f'({{"0": "1700000000000-0"}}), Unix ms or an ISO-8601 time; got {value!r}'
        ) from None
    return int(when.replace(tzinfo=when.tzinfo or UTC).timestamp() * 1000)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches on the driver, reads them in tasks (one per shard with new entries).

    ``Trigger.AvailableNow``: the entries present when the query starts are read, in
    micro-batches of at most ``maxOffsetsPerTrigger``, then the query stops. The streaming
    progress reports, as ``latestOffset``, the last entry of each shard now readable (a query's
    lag is its end offset against it)."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        self.opts = opts
        self.schema = schema
        self.start = parse_start(opts.starting_offsets, opts.topic)
        self.target: dict[int, EntryId] | None = None  # Trigger.AvailableNow: where to stop
        self.latest: Offset | None = None  # for reportLatestOffset
        self._listed: dict[int, list[SegmentRef]] = {}  # per shard, the segments seen so far

    def __getstate__(self) -> dict[str, Any]:  # tasks get the reader without the listing cache
        state = dict(self.__dict__)
        state["_listed"] = {}
        return state

    def _segments(self, objects: Objects, shard: int) -> list[SegmentRef]:
        """The shard's segments, listing only the keys after the last one seen (segments are
        immutable and a new one's key sorts after the known ones: no full listing per batch)."""
        known = self._listed.setdefault(shard, [])
        known += objects.segments(self.opts.topic, shard, after=known[-1] if known else None)
        return known

    def prepareForTriggerAvailableNow(self) -> None:
        _, redis, _, self.target = self._heads()
        if redis is not None:
            redis.close()

    def reportLatestOffset(self) -> dict[str, Offset] | None:
        return None if self.latest is None else {self.opts.topic: self.latest}

    # Spark sees offsets keyed by topic, as Kafka's ({"orders": {"0": "<entry ID>"}}); they are
    # per shard inside. A checkpoint of another topic is refused; an older checkpoint's offsets,
    # per shard only, are taken as they are.
    def initialOffset(self) -> dict[str, Offset]:
        return {self.opts.topic: self._initial_offset()}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Offset]:
        return {self.opts.topic: self._latest_offset(self._own(start), limit)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return self._partitions(self._own(start), self._own(end))

    def _own(self, offset: dict[str, Any]) -> Offset:
        """The per-shard offset of this query's topic. Raises `ConfigError` for a checkpoint of
        another topic (its entry IDs would be read as this topic's: a silent misread)."""
        if offset and all(isinstance(v, dict) for v in offset.values()):
            if set(offset) != {self.opts.topic}:
                raise ConfigError(
                    f"the query's checkpoint holds offsets of topic(s) {sorted(offset)}, not "
                    f"{self.opts.topic!r}: use a new checkpointLocation for another topic"
                )
            return {str(k): str(v) for k, v in offset[self.opts.topic].items()}
        return {str(k): str(v) for k, v in offset.items()}

    # -- driver side --------------------------------------------------------------------------
    def _shards(self, objects: Objects, redis: Any) -> list[int]:
        count = shard_count(redis, self.opts.keys(), self.opts.topic, self.opts.shards)
        return sorted(set(objects.shards(self.opts.topic)) | set(range(count or 0)))

    def _heads(self) -> tuple[Objects, Any, dict[int, EntryId], dict[int, EntryId]]:
        """(objects, redis, checkpoints, heads): per shard the last entry now readable."""
        objects = as_objects(self.opts.open_store())
        redis = self.opts.redis()
        shards = self._shards(objects, redis)
        keys = self.opts.keys()
        cps = checkpoints(redis, keys, self.opts.topic, shards) if redis is not None else {}
        heads: dict[int, EntryId] = {}
        for s in shards:
            refs = self._segments(objects, s)
            if redis is not None:
                upto = archived_upto(cps.get(s), refs)
                if upto is not None:
                    cps[s] = upto  # where the archive ends, for `_nth`
            heads[s] = max([refs[-1].last] if refs else [], default=ZERO)
            if s in cps:
                heads[s] = max(heads[s], cps[s])
        if redis is not None:
            for s, last in last_ids(redis, keys, self.opts.topic, shards).items():
                heads[s] = max(heads.get(s, ZERO), last)
        return objects, redis, cps, heads

    def _initial_offset(self) -> Offset:
        _, redis, _, heads = self._heads()
        if redis is not None:
            redis.close()
        if self.start == "latest":
            return {str(s): str(h) for s, h in heads.items()}
        if isinstance(self.start, int):
            at = EntryId(self.start, 0)
            return {str(s): str(at.prev()) if self.start > 0 else "0-0" for s in heads}
        given = self.start if isinstance(self.start, dict) else {}
        return {str(s): given.get(str(s), "0-0") for s in heads}

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_entries_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def _latest_offset(self, start: Offset, limit: ReadLimit) -> Offset:
        objects, redis, cps, heads = self._heads()
        self.latest = {str(s): str(h) for s, h in heads.items()}
        if self.target is not None:  # nothing added after the AvailableNow query started
            heads = {s: min(h, self.target.get(s, ZERO)) for s, h in heads.items()}
        try:
            end = {str(s): str(h) for s, h in heads.items()}
            beyond = []
            for key, was in start.items():  # never move backwards (a shard's stream deleted)
                if parse_id(end.get(key, "0-0")) < parse_id(was):
                    beyond.append(f"shard {key} at {was}, last entry {end.get(key, 'none')}")
                    end[key] = was
            if beyond and redis is not None:  # as replay's ArchiveGap: else a silent hole
                # (without Redis the archive may just not have caught up with the offsets yet)
                surface_loss(self.opts.topic, beyond, self.opts.on_gap or "fail")
            if not isinstance(limit, ReadMaxRows):
                return end
            behind = [int(k) for k in end if parse_id(end[k]) > parse_id(start.get(k, "0-0"))]
            quota = max(1, limit.max_rows // max(1, len(behind)))
            for s in behind:
                after = parse_id(start.get(str(s), "0-0"))
                cut = self._nth(objects, redis, s, after, heads[s], cps.get(s), quota)
                end[str(s)] = str(cut)
            return end
        finally:
            if redis is not None:
                redis.close()

    def _nth(
        self,
        objects: Objects,
        redis: Any,
        shard: int,
        after: EntryId,
        head: EntryId,
        cp: EntryId | None,
        n: int,
    ) -> EntryId:
        """The `n`-th entry ID of `shard` after `after` (or `head` if there are fewer)."""
        topic = self.opts.topic
        left = n
        last = after
        for ref in self._segments(objects, shard):
            if ref.last <= after or (redis is not None and (cp is None or ref.last > cp)):
                continue
            if ref.first > after:
                meta = parquet_footer(objects, ref).metadata or {}
                count = int(meta.get(b"eventbus.entries", b"0"))
                if count <= left:
                    left -= count
                    last = ref.last
                    if left == 0:
                        return last
                    continue
            ids = _segment_ids(objects, ref, after)
            if len(ids) >= left:
                return ids[left - 1]
            left -= len(ids)
            last = ref.last
        if redis is None:
            return min(last, head) if left < n else head
        start = max(after, cp) if cp is not None else after
        page = redis.xrange(
            self.opts.keys().stream(topic, shard),
            f"({start}" if start > ZERO else "-",
            str(head),
            count=left,
        )
        return parse_id(page[-1][0]) if page else max(last, start)

    def _partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        objects = as_objects(self.opts.open_store())
        redis = self.opts.redis()
        try:
            shards = sorted(int(s) for s in end)
            cps = (
                checkpoints(redis, self.opts.keys(), self.opts.topic, shards)
                if redis is not None
                else {}
            )
            parts: list[InputPartition] = []
            lost: list[dict[str, Any]] = []
            for s in shards:
                after = parse_id(start.get(str(s), "0-0"))
                upto = parse_id(end[str(s)])
                if upto <= after:
                    continue
                listed = self._segments(objects, s)
                cp = archived_upto(cps.get(s), listed) if redis is not None else upto
                refs = tuple(
                    r
                    for r in listed
                    if r.last > after and r.first <= upto and (cp is not None and r.last <= cp)
                )
                parts.append(
                    RangePart(self.opts.topic, s, None if after == ZERO else after, upto, cp, refs)
                )
                lost += [g for g in objects.gaps(self.opts.topic, s) if _lost_in(g, after, upto)]
            # Kafka's failOnDataLoss, default true: entries lost in this batch's range fail it
            surface_gaps(self.opts.topic, lost, self.opts.on_gap or "fail")
            return parts
        finally:
            if redis is not None:
                redis.close()

    def commit(self, end: Offset) -> None:
        """Nothing to do: offsets live in Spark's checkpoint, entries stay where they are."""

    # -- task side ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePart)
        opts = self.opts
        objects = as_objects(opts.open_store())
        conv = Converter(arrow_schema(self.schema), opts.models(), opts.mode, opts.validate)
        redis = opts.redis()
        try:
            for batch in read_range(objects, redis, opts.keys(), partition):
                yield conv.convert(batch)
        finally:
            if redis is not None:
                redis.close()


def surface_loss(topic: str, beyond: list[str], on_gap: str) -> None:
    """The query's offsets are past the archive's and the stream's last entries (the stream was
    deleted and recreated, or the store is another): fail (failOnDataLoss) or warn."""
    text = (
        f"topic {topic!r}: the query's offsets are beyond the archive and the stream ("
        + "; ".join(beyond[:5])
        + "): entries added there would be skipped; failOnDataLoss=false reads on"
    )
    if on_gap == "fail":
        raise TierError(text)
    log.warning(text)
    warnings.warn(text, RuntimeWarning, stacklevel=2)


def _lost_in(gap: dict[str, Any], after: EntryId, upto: EntryId) -> bool:
    """Whether gap record `gap` (entries lost strictly between its after and before) overlaps
    the range (`after`, `upto`]."""
    return parse_id(gap["before"]) > after.next() and parse_id(gap["after"]) < upto


def _segment_ids(objects: Objects, ref: SegmentRef, after: EntryId) -> list[EntryId]:
    """The entry IDs of segment `ref` after `after`, in order (reads its two ID columns)."""
    table = pq.read_table(io.BytesIO(objects.get(ref.key)), columns=["entry_ms", "entry_seq"])
    pairs = zip(
        table.column("entry_ms").to_pylist(), table.column("entry_seq").to_pylist(), strict=True
    )
    return [e for e in (EntryId(ms, seq) for ms, seq in pairs) if e > after]
