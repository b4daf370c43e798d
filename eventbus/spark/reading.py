"""Reading planned parts: verified segments (`segment_batches`), and one shard's range across
segments and Redis.

**Reading (after, upto]** (`read_range`) stays exact while an offloader runs: the checkpoint
``C1`` is read again *after* each ``XRANGE`` page; entries the offloader archived and trimmed
meanwhile (``C < id <= C1``) are taken from the segments it committed, the rest from the page.
An entry after ``C1`` cannot have been trimmed by the offloader before the page was read (it
trims only below its checkpoint), so nothing is missed and nothing is read twice; the next page
starts after what was given.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.keys import Keys
from eventbus.spark.matching import ReadTyping, TypedColumnConflict, match, segment_typing
from eventbus.spark.objects import Objects, parquet_footer
from eventbus.spark.planning import RangePart, checkpoints
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment import SCHEMA, entry_arrays
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.typed import ERROR_COLUMN

if TYPE_CHECKING:
    from eventbus.spark.decode import Converter
    from eventbus.spark.options import SourceOptions

XRANGE_COUNT = 5000
INT64_MAX = (1 << 63) - 1
BATCH_ROWS = 32768


def segment_batches(
    objects: Objects, ref: SegmentRef, typed: ReadTyping | None = None
) -> list[pa.RecordBatch]:
    """Segment `ref` fetched, verified against its key and cut into segment-schema batches of
    at most `BATCH_ROWS` rows. The tier's one reader (`eventbus.tier.segment_read.decode_segment`)
    makes the checks. With `typed` (a typed read's models), the segment's typed columns and
    ``typed_error`` are appended when they give that read's columns exactly (`typed_columns`):
    the payloads need no decoding then. Raises `CorruptSegment` naming the key,
    `StoreError`."""
    data = objects.get(ref.key)
    table, info = decode_segment(data, ref.key, expect=ref.span)
    if typed is not None and info.typed_models:
        extra = typed_columns(data, ref, typed)
        if extra is not None:
            for name in extra.column_names:
                table = table.append_column(name, extra.column(name))
    batches: list[pa.RecordBatch] = table.to_batches(max_chunksize=BATCH_ROWS)
    return batches


def typed_columns(data: bytes, ref: SegmentRef, typed: ReadTyping) -> pa.Table | None:
    """The typed columns of a read of `typed` and ``typed_error`` from segment file `data`,
    when the segment's typed columns were written for the read's event types with the same
    columns (`eventbus.spark.matching`) and lack none of them (a column a segment lacks would
    be null, where decoding ``data`` gives the field's default): else None."""
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        seg = segment_typing(ref.key, pf.metadata)
        if match(typed, [seg]).native != [0] or not set(typed.kinds) <= set(seg.columns):
            return None
        return pf.read(columns=[*typed.kinds, ERROR_COLUMN])
    except (TypedColumnConflict, ValueError, KeyError, pa.ArrowException):
        return None  # another version of the columns: `data` is decoded instead


def entries_batch(
    topic: str, shard: int, entries: Sequence[tuple[EntryId, Mapping[bytes, bytes]]]
) -> pa.RecordBatch:
    """Redis entries (ID, field map) as one segment-schema batch, built as the offloader builds
    a segment (`eventbus.tier.segment.entry_arrays`)."""
    rows = [(entry_id, dict(fields)) for entry_id, fields in entries]
    return pa.RecordBatch.from_arrays(entry_arrays(topic, shard, rows), schema=SCHEMA)


def id_mask(batch: pa.RecordBatch, after: EntryId | None, upto: EntryId | None) -> Any:
    """Boolean mask of rows with `after` < entry ID <= `upto` (either bound may be None)."""
    ms, seq = batch.column("entry_ms"), batch.column("entry_seq")
    mask = None
    # sequence parts up to 2^64 - 1 (`EntryId.prev`, `MAX_ID`) against the int64 column, whose
    # values never exceed 2^63 - 1: clamped (pyarrow refuses a scalar beyond int64)
    if after is not None:
        after_seq = pa.scalar(min(after.seq, INT64_MAX), pa.int64())
        m = pc.or_(
            pc.greater(ms, after.ms), pc.and_(pc.equal(ms, after.ms), pc.greater(seq, after_seq))
        )
        mask = m
    if upto is not None:
        upto_seq = pa.scalar(min(upto.seq, INT64_MAX), pa.int64())
        m = pc.or_(
            pc.less(ms, upto.ms), pc.and_(pc.equal(ms, upto.ms), pc.less_equal(seq, upto_seq))
        )
        mask = m if mask is None else pc.and_(mask, m)
    return mask


def stats_exclude(
    objects: Objects, ref: SegmentRef, time_lo: int | None, time_hi: int | None
) -> bool:
    """Whether the segment's Parquet statistics of ``event_time_ms`` show no row in
    [`time_lo`, `time_hi`] (reads only the footer). False when unsure."""
    if time_lo is None and time_hi is None:
        return False
    try:
        meta = parquet_footer(objects, ref)
    except Exception:  # unreadable footer: let the full read report it
        return False
    col = meta.schema.names.index("event_time_ms")
    for i in range(meta.num_row_groups):
        st = meta.row_group(i).column(col).statistics
        if st is None or not st.has_min_max or st.null_count:
            return False
        if (time_hi is None or st.min <= time_hi) and (time_lo is None or st.max >= time_lo):
            return False
    return True


def read_segments(
    objects: Objects,
    refs: Sequence[SegmentRef],
    after: EntryId | None,
    upto: EntryId | None,
    typed: ReadTyping | None = None,
) -> Iterator[pa.RecordBatch]:
    """Rows of `refs` with `after` < ID <= `upto`, as segment-schema batches (with the typed
    columns of `typed` when they match: `segment_batches`), in order; each entry once when
    segments overlap (rows up to the last one given are dropped)."""
    for ref in refs:
        if (after is not None and ref.last <= after) or (upto is not None and ref.first > upto):
            continue
        for batch in segment_batches(objects, ref, typed):
            cut = (after is not None and ref.first <= after) or (
                upto is not None and ref.last > upto
            )
            if cut:
                batch = batch.filter(id_mask(batch, after, upto))
            if batch.num_rows:
                yield batch
                n = batch.num_rows - 1
                ms, seq = batch.column("entry_ms")[n].as_py(), batch.column("entry_seq")[n].as_py()
                after = EntryId(ms, seq)


def converted_range(
    opts: SourceOptions, objects: Objects, part: RangePart, conv: Converter
) -> Iterator[pa.RecordBatch]:
    """`part` read by `read_range` in a task, each batch converted by `conv` to the read
    schema; the Redis client of `opts` (None without ``redis_url``: a part of segments only)
    is closed after."""
    redis = opts.redis()
    try:
        for batch in read_range(objects, redis, opts.keys(), part, conv.read_typing):
            yield conv.convert(batch)
    finally:
        if redis is not None:
            redis.close()


def read_range(
    objects: Objects, redis: Any, keys: Keys, part: RangePart, typed: ReadTyping | None = None
) -> Iterator[pa.RecordBatch]:
    """Shard `part.shard`'s entries in (`part.after`, `part.upto`] as segment-schema batches in
    entry-ID order: segments `part.refs`, then ``XRANGE`` after the checkpoint `part.cp`, page
    by page (`XRANGE_COUNT` entries: a shard's tail is never held at once), each page followed
    by the re-check of the module docstring."""
    topic, shard = part.topic, part.shard
    yield from read_segments(objects, part.refs, part.after, part.upto, typed)
    low = (
        part.cp
        if part.after is None or (part.cp is not None and part.cp > part.after)
        else (part.after)
    )
    stream = keys.stream(topic, shard)
    while low is None or low < part.upto:
        first = f"({low}" if low is not None else "-"
        page = redis.xrange(stream, first, str(part.upto), count=XRANGE_COUNT)
        now = checkpoints(redis, keys, topic, [shard]).get(shard)
        if now is not None and (low is None or now > low):
            # archived (and maybe trimmed) since `low`: those entries come from the segments
            upto = min(now, part.upto)
            fresh = [r for r in objects.segments(topic, shard) if (low is None or r.last > low)]
            yield from read_segments(objects, fresh, low, upto, typed)
            low = upto
        rest = [(parse_id(i), f) for i, f in page]
        rest = [e for e in rest if low is None or e[0] > low]
        if rest:
            yield entries_batch(topic, shard, rest)
            low = rest[-1][0]
        if len(page) < XRANGE_COUNT:
            return
