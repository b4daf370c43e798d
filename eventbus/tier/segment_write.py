"""Segment files written: `encode_columns` checks the columns' order (`eventbus.tier.
segment_columns.EntryColumns`) and writes them as Parquet with zstd and per-column encodings;
`encode_segment` does both for entries given as (ID, field map). The format is
`eventbus.tier.segment`'s; `eventbus.tier.segment_read` reads and verifies it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.protocol.codec import _ENCODER, FORMAT_MSGPACK
from eventbus.protocol.ids import EntryId
from eventbus.tier import rebuild, segment
from eventbus.tier.segment import (
    _DATA,
    COLUMNS,
    REBUILT_SCHEMA,
    SCHEMA,
    RawEntry,
    SegmentInfo,
    _after_previous,
)
from eventbus.tier.segment_columns import EntryColumns, entry_columns
from eventbus.tier.typed import ERROR_COLUMN, TypedPayloads


def _misplaced(ms: Any, seq: Any, first: EntryId, last: EntryId) -> int | None:
    """The index of the first entry not after the one before it or outside `first`..`last`
    (None: all in order and in range), on whole columns."""
    n = len(ms)
    if n == 0:
        return None
    first_ok = pc.or_(
        pc.greater(ms, first.ms), pc.and_(pc.equal(ms, first.ms), pc.greater_equal(seq, first.seq))
    )
    last_ok = pc.or_(
        pc.less(ms, last.ms), pc.and_(pc.equal(ms, last.ms), pc.less_equal(seq, last.seq))
    )
    ok = pc.and_(first_ok, last_ok)
    if n > 1:
        ok = pc.and_(ok, pa.concat_arrays([pa.array([True]), _after_previous(ms, seq)]))
    if pc.all(ok).as_py():
        return None
    return int(pc.index(ok, False).as_py())


# Parquet encodings per column (transparent to readers: the columns and their types are the
# same). Entry IDs and times increase: delta-encoded they take a tenth of the bytes; the event
# ID (random) and the envelope bytes are unique per entry, where a dictionary only costs time;
# the other columns (topic, rid, type, headers, typed payload fields) keep pyarrow's default
# dictionary encoding, which falls back to plain encoding when a column has too many values.
_ENCODINGS = {
    "entry_id": "DELTA_BYTE_ARRAY",
    "entry_ms": "DELTA_BINARY_PACKED",
    "entry_seq": "DELTA_BINARY_PACKED",
    "event_time_ms": "DELTA_BINARY_PACKED",
    "event_id": "DELTA_LENGTH_BYTE_ARRAY",
    "data": "DELTA_LENGTH_BYTE_ARRAY",
}
_UNDICTIONARIED = frozenset(_ENCODINGS) | {"shard"}


def _leaves(name: str, kind: pa.DataType) -> list[str]:
    """The Parquet column paths of an Arrow field (pyarrow's compliant nested names)."""
    if pa.types.is_struct(kind):
        return [p for f in kind for p in _leaves(f"{name}.{f.name}", f.type)]
    if pa.types.is_map(kind):
        return [
            *_leaves(f"{name}.key_value.key", kind.key_type),
            *_leaves(f"{name}.key_value.value", kind.item_type),
        ]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _leaves(f"{name}.list.element", kind.value_type)
    return [name]


def encode_columns(
    topic: str,
    shard: int,
    first: EntryId,
    last: EntryId,
    cols: EntryColumns,
    *,
    zstd_level: int = 3,
    typed: TypedPayloads | None = None,
    rebuild_data: bool = False,
) -> tuple[bytes, SegmentInfo]:
    """Encode `cols` (entries in entry-ID order, all within `first`..`last`; built with the
    same `typed` by `entry_columns`) as a segment file; with `typed`, a typed segment (its
    payload also as typed columns, see the module docstring); with `rebuild_data` too, of
    version 3 when some model's fields are all JSON-native: ``data`` null where the columns
    rebuild it exactly (`eventbus.tier.rebuild`).

    Returns the file's bytes and its `SegmentInfo`. CPU-bound, mostly without the GIL (Parquet
    encoding, zstd): call it in a worker thread from async code. Raises `ValueError` if the
    entries are out of order or outside the range."""
    arrays = list(cols.arrays)
    ms, seq = arrays[3], arrays[4]
    bad = _misplaced(ms, seq, first, last)
    if bad is not None:
        entry_id = EntryId(ms[bad].as_py(), seq[bad].as_py())
        raise ValueError(f"entry {entry_id} out of order or outside {first}..{last}")
    n = len(ms)
    schema = SCHEMA
    info = SegmentInfo(topic, shard, first, last, n, cols.raw_bytes)
    extra: dict[str, str] = {}
    if typed is not None:
        if cols.typed is None or cols.typed_errors is None:
            raise ValueError("typed segment from columns built without models")
        errors = cols.typed_errors
        payload = cols.typed.flatten()
        error_array = pa.array(errors, pa.string())
        arrays += [*payload, error_array]
        fields = rebuild.rebuildable(typed) if rebuild_data else {}
        base = REBUILT_SCHEMA if fields else SCHEMA
        schema = pa.schema([*base, *typed.struct, pa.field(ERROR_COLUMN, pa.string())])
        invalid = n - errors.count(None)
        rebuilt = 0
        if fields:
            named = dict(zip(COLUMNS, arrays, strict=False))
            named |= {f.name: a for f, a in zip(typed.struct, payload, strict=True)}
            same = _reencoded(fields, typed, cols)
            if same is not None:  # a row whose typed columns are null (e.g. an int past int64)
                same = [s and e is None for s, e in zip(same, errors, strict=True)]  # keeps data
            if same is None:
                data = rebuild.unneeded(fields, arrays[_DATA], arrays[6], error_array, named)
            elif any(same):
                data = pc.if_else(
                    pa.array(same, pa.bool_()), pa.nulls(n, pa.binary()), arrays[_DATA]
                )
            else:
                data = arrays[_DATA]
            arrays[_DATA] = data
            rebuilt = arrays[_DATA].null_count
        info = SegmentInfo(
            topic,
            shard,
            first,
            last,
            n,
            cols.raw_bytes,
            typed.spec,
            typed.version,
            invalid,
            rebuild.fields_text(fields) if fields else None,
            rebuilt,
        )
        extra = {
            "eventbus.typed_models": typed.spec,
            "eventbus.typed_version": typed.version,
            "eventbus.typed_invalid": str(invalid),
        }
        if fields:
            extra |= {
                "eventbus.data_fields": rebuild.fields_text(fields),
                "eventbus.data_rebuilt": str(rebuilt),
            }
    version = segment.FORMAT_VERSION if typed is None else segment.TYPED_VERSION
    if info.data_fields is not None:
        version = segment.REBUILT_VERSION
    metadata = {
        "eventbus.segment_version": version,
        "eventbus.topic": topic,
        "eventbus.shard": str(shard),
        "eventbus.first": str(first),
        "eventbus.last": str(last),
        "eventbus.entries": str(n),
        "eventbus.raw_bytes": str(cols.raw_bytes),
        **extra,
    }
    table = pa.Table.from_arrays(arrays, schema=schema.with_metadata(metadata))
    return write_parquet(table, zstd_level), info


def write_parquet(
    table: pa.Table,
    zstd_level: int = 3,
    *,
    row_group: int | None = None,
    page_rows: int | None = None,
    page_index: bool | None = None,
) -> bytes:
    """`table` (a segment's columns and metadata) as the segment file's bytes: zstd, page
    checksums, the per-column encodings (`_ENCODINGS`), row groups of `_ROW_GROUP` rows, data
    pages of at most `_PAGE_ROWS` rows and a page index (`_PAGE_INDEX`). The keywords override
    those three for `stress/segment_layout_bench.py`, which measured them."""
    dictionary = [
        path
        for field in table.schema
        if field.name not in _UNDICTIONARIED
        for path in _leaves(field.name, field.type)
    ]
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=zstd_level,
        write_page_checksum=True,
        row_group_size=_ROW_GROUP if row_group is None else row_group,
        max_rows_per_page=_PAGE_ROWS if page_rows is None else page_rows,
        write_page_index=_PAGE_INDEX if page_index is None else page_index,
        use_dictionary=dictionary,
        column_encoding=_ENCODINGS,
    )
    return sink.getvalue()


# The layout a bounded read prunes by (`entry_ms` range: Spark pushes it to its Parquet reader,
# which skips row groups, and with a page index pages, whose statistics are outside it).
_ROW_GROUP = 65536
_PAGE_ROWS = 2000  # pages end at 1 MiB or these many rows (pyarrow's default: 20,000)
_PAGE_INDEX = True


def _reencoded(
    fields: Mapping[str, Sequence[str]], typed: TypedPayloads, cols: EntryColumns
) -> list[bool] | None:
    """Per entry whether `eventbus.tier.rebuild` gives its ``data`` back, found without
    rebuilding, when every payload of `cols` was decoded into the mirror of one rebuildable
    model (`_decode_all`): the typed columns then hold the decoded values as they are (Arrow
    gives back the same int, float, str, bool or None), so the rebuilt bytes are the decoded
    body encoded again, which `rebuild.rebuild` encodes the same way (the same map, fields in
    the model's order). None when not known this way (`rebuild.unneeded` decides)."""
    bodies, datas = cols.bodies, cols.datas
    if not bodies or datas is None:
        return None
    kinds = {type(b.p) for b in bodies}
    if len(kinds) != 1:
        return None
    mirror = kinds.pop()
    keys = [k for k, m in typed.mirrors.items() if m is mirror]
    if not keys:
        return None
    names = fields.get("*" if keys[0] is None else keys[0])
    if names is None or tuple(names) != mirror.__struct_fields__:
        return None
    # the common case, all at once: the bodies encoded as one array interleaved with the
    # format byte (1, body, 1, body...) are the array's header and then the entries' ``data``
    n = len(bodies)
    interleaved: list[Any] = [FORMAT_MSGPACK] * (2 * n)
    interleaved[1::2] = bodies
    encoded = _ENCODER.encode(interleaved)
    joined = b"".join(datas)
    header = 1 if 2 * n < 16 else 3 if 2 * n < 65536 else 5  # fixarray, array 16, array 32
    if len(encoded) == header + len(joined) and encoded.endswith(joined):
        return [True] * n
    again = list(map(_ENCODER.encode, bodies))
    return [len(d) == len(e) + 1 and d.endswith(e) for d, e in zip(datas, again, strict=True)]


def encode_segment(
    topic: str,
    shard: int,
    first: EntryId,
    last: EntryId,
    entries: Sequence[RawEntry],
    *,
    zstd_level: int = 3,
    typed: TypedPayloads | None = None,
    rebuild_data: bool = False,
) -> tuple[bytes, SegmentInfo]:
    """`encode_columns` of `entries` (ID, field map), in entry-ID order, all within
    `first`..`last`; with `typed`, a typed segment (`rebuild_data`: as `encode_columns`).
    Returns the file's bytes and its `SegmentInfo`. CPU-bound: call it in a worker thread from
    async code. Raises `ValueError` if the entries are out of order or outside the range."""
    cols = entry_columns(topic, shard, [str(i) for i, _ in entries], [f for _, f in entries], typed)
    return encode_columns(
        topic,
        shard,
        first,
        last,
        cols,
        zstd_level=zstd_level,
        typed=typed,
        rebuild_data=rebuild_data,
    )
