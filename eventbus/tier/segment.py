"""The segment format: one immutable Parquet file (zstd) per run of a shard's entries.

One row per stream entry, in entry-ID order. Columns (docs/tier.md is the spec):

=============== ====================== =========================================================
column          Arrow type             meaning
=============== ====================== =========================================================
topic           string (dictionary)    topic name
shard           int32                  shard index
entry_id        string                 Redis entry ID ``<ms>-<seq>``
entry_ms        int64                  its millisecond part (Redis time the entry was added)
entry_seq       int64                  its sequence part
resource_id     string, nullable       the entry's ``rid`` field
event_type      string, nullable       the entry's ``type`` field
event_time_ms   int64, nullable        envelope time (publisher clock, Unix ms)
event_id        string, nullable       envelope event ID as a UUID text
headers         map<string, string>,   envelope headers
                nullable
data            binary                 the entry's raw ``data`` field (envelope bytes; decode
                                       with `eventbus.protocol.codec.decode_entry`)
=============== ====================== =========================================================

Envelope-derived columns are null when the entry's envelope does not decode; the raw ``data``
bytes are kept regardless. A *typed* segment (the topic has registered models:
`eventbus.tier.typed`) has more columns after ``data``: one per model field (the payload as
typed values, null where the entry's type has no model or its payload does not validate), then
``typed_error`` (string: why a modelled entry's typed columns are null). ``data`` stays the
source of truth. The file's key-value metadata holds ``eventbus.segment_version``
(``1``; ``2`` for a typed segment, which also has ``eventbus.typed_models``, the models as
``{"<event type>": "module:Name"}``, ``eventbus.typed_version``, a fingerprint of the models
and their columns' types, and ``eventbus.typed_invalid``, the entries whose payload did not
validate), ``eventbus.topic``, ``eventbus.shard``, ``eventbus.first``, ``eventbus.last`` (the range
the key names), ``eventbus.entries`` and ``eventbus.raw_bytes`` (field names + values of the
entries, as counted against ``max_payload_bytes``). Data pages carry CRC32 checksums, verified
on read.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, decode_entry, encoded_size
from eventbus.protocol.ids import EntryId
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.typed import ERROR_COLUMN, TypedPayloads

FORMAT_VERSION = "1"
TYPED_VERSION = "2"

SCHEMA = pa.schema(
    [
        pa.field("topic", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("entry_id", pa.string(), nullable=False),
        pa.field("entry_ms", pa.int64(), nullable=False),
        pa.field("entry_seq", pa.int64(), nullable=False),
        pa.field("resource_id", pa.string()),
        pa.field("event_type", pa.string()),
        pa.field("event_time_ms", pa.int64()),
        pa.field("event_id", pa.string()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
        pa.field("data", pa.binary(), nullable=False),
    ]
)
COLUMNS = tuple(SCHEMA.names)

RawEntry = tuple[EntryId, dict[bytes, bytes]]
"""An entry as read from Redis: its ID and its field map."""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a segment's metadata says: topic, shard, the key's range, entries, raw bytes."""

    topic: str
    shard: int
    first: EntryId
    last: EntryId
    entries: int
    raw_bytes: int
    typed_models: str | None = None  # typed segments: `eventbus.tier.typed.models_spec`
    typed_version: str | None = None  # `TypedPayloads.version`
    typed_invalid: int = 0  # entries of a modelled type whose payload did not validate


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _map_array(offsets: list[int], null: list[bool], keys: list[str], values: list[str]) -> Any:
    """A map<string, string> array (built from offsets: far faster than from Python pairs)."""
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(keys, pa.string()),
        pa.array(values, pa.string()),
        mask=pa.array(null, pa.bool_()) if any(null) else None,
    )


def entry_arrays(topic: str, shard: int, entries: Sequence[RawEntry]) -> list[Any]:
    """`entries` (ID, field map) as the segment schema's columns, in `SCHEMA` order: envelope
    columns null where the envelope does not decode. Used by the offloader (`encode_segment`)
    and by readers of the Redis tail that must give the same rows (`eventbus.spark`)."""
    cols: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    header_keys: list[str] = []
    header_values: list[str] = []
    header_offsets: list[int] = [0]
    header_null: list[bool] = []  # a null map: the envelope did not decode
    for entry_id, fields in entries:
        cols["entry_id"].append(str(entry_id))
        cols["entry_ms"].append(entry_id.ms)
        cols["entry_seq"].append(entry_id.seq)
        cols["resource_id"].append(_text(fields.get(F_RESOURCE)))
        cols["event_type"].append(_text(fields.get(F_TYPE)))
        cols["data"].append(fields.get(F_DATA, b""))
        try:
            env = decode_entry(fields)
        except DecodeError:
            cols["event_time_ms"].append(None)
            cols["event_id"].append(None)
            header_offsets.append(len(header_keys))
            header_null.append(True)
        else:
            cols["event_time_ms"].append(env.published_at_ms)
            cols["event_id"].append(str(env.event_id))
            header_keys.extend(env.headers)
            header_values.extend(env.headers.values())
            header_offsets.append(len(header_keys))
            header_null.append(False)
    n = len(entries)
    return [
        pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array([topic])),
        pa.array([shard] * n, pa.int32()),
        *(pa.array(cols[name], SCHEMA.field(name).type) for name in COLUMNS[2:9]),
        _map_array(header_offsets, header_null, header_keys, header_values),
        pa.array(cols["data"], pa.binary()),
    ]


def encode_segment(
    topic: str,
    shard: int,
    first: EntryId,
    last: EntryId,
    entries: Sequence[RawEntry],
    *,
    zstd_level: int = 3,
    typed: TypedPayloads | None = None,
) -> tuple[bytes, SegmentInfo]:
    """Encode `entries` (in entry-ID order, all within `first`..`last`) as a segment file;
    with `typed`, a typed segment (its payload also as typed columns, see the module docstring).

    Returns the file's bytes and its `SegmentInfo`. CPU-bound: call it in a worker thread from
    async code. Raises `ValueError` if the entries are out of order or outside the range.
    """
    prev: EntryId | None = None
    raw_bytes = 0
    for entry_id, fields in entries:
        if not first <= entry_id <= last or (prev is not None and entry_id <= prev):
            raise ValueError(f"entry {entry_id} out of order or outside {first}..{last}")
        prev = entry_id
        raw_bytes += encoded_size(fields)
    n = len(entries)
    arrays = entry_arrays(topic, shard, entries)
    schema = SCHEMA
    info = SegmentInfo(topic, shard, first, last, n, raw_bytes)
    extra: dict[str, str] = {}
    if typed is not None:
        struct, errors = typed.columns(arrays[-1].to_pylist(), arrays[6].to_pylist())
        arrays += [*struct.flatten(), pa.array(errors, pa.string())]
        schema = pa.schema([*SCHEMA, *typed.struct, pa.field(ERROR_COLUMN, pa.string())])
        invalid = n - errors.count(None)
        info = SegmentInfo(
            topic, shard, first, last, n, raw_bytes, typed.spec, typed.version, invalid
        )
        extra = {
            "eventbus.typed_models": typed.spec,
            "eventbus.typed_version": typed.version,
            "eventbus.typed_invalid": str(invalid),
        }
    metadata = {
        "eventbus.segment_version": FORMAT_VERSION if typed is None else TYPED_VERSION,
        "eventbus.topic": topic,
        "eventbus.shard": str(shard),
        "eventbus.first": str(first),
        "eventbus.last": str(last),
        "eventbus.entries": str(n),
        "eventbus.raw_bytes": str(raw_bytes),
        **extra,
    }
    table = pa.Table.from_arrays(arrays, schema=schema.with_metadata(metadata))
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=zstd_level,
        write_page_checksum=True,
        row_group_size=65536,
    )
    return sink.getvalue(), info


def _meta(schema: Any, name: str, key: str) -> str:
    raw = (schema.metadata or {}).get(f"eventbus.{name}".encode())
    if raw is None:
        raise CorruptSegment(key, f"metadata lacks eventbus.{name}")
    return bytes(raw).decode()


def read_info(schema: Any, key: str) -> SegmentInfo:
    """The `SegmentInfo` in an Arrow schema's metadata. Raises `CorruptSegment`."""
    from eventbus.protocol.ids import parse_id

    try:
        version = _meta(schema, "segment_version", key)
        if version not in (FORMAT_VERSION, TYPED_VERSION):
            raise CorruptSegment(key, f"unsupported segment version {version!r}")
        typed = version == TYPED_VERSION
        return SegmentInfo(
            topic=_meta(schema, "topic", key),
            shard=int(_meta(schema, "shard", key)),
            first=parse_id(_meta(schema, "first", key)),
            last=parse_id(_meta(schema, "last", key)),
            entries=int(_meta(schema, "entries", key)),
            raw_bytes=int(_meta(schema, "raw_bytes", key)),
            typed_models=_meta(schema, "typed_models", key) if typed else None,
            typed_version=_meta(schema, "typed_version", key) if typed else None,
            typed_invalid=int(_meta(schema, "typed_invalid", key)) if typed else 0,
        )
    except CorruptSegment:
        raise
    except Exception as exc:  # int() / parse_id on garbage metadata
        raise CorruptSegment(key, f"bad metadata: {exc}") from None


def check_schema(schema: pa.Schema, info: SegmentInfo, key: str) -> None:
    """Raise `CorruptSegment` unless `schema` starts with `SCHEMA`'s columns and has more only
    in a typed segment (ending with ``typed_error``)."""
    fields = list(schema)
    extra = fields[len(SCHEMA) :]
    ok = pa.schema(fields[: len(SCHEMA)]) == pa.schema(list(SCHEMA))
    if info.typed_version is None:
        ok = ok and not extra
    else:
        ok = ok and bool(extra) and extra[-1] == pa.field(ERROR_COLUMN, pa.string())
    if not ok:
        raise CorruptSegment(key, f"unexpected schema {schema}")


def decode_segment(
    data: bytes,
    key: str,
    *,
    expect: tuple[str, int, EntryId, EntryId] | None = None,
    columns: Sequence[str] | None = None,
) -> tuple[pa.Table, SegmentInfo]:
    """Parse and verify a segment file; `key` names it in errors. The one segment reader:
    replay (`eventbus.tier.archived`), the offloader adopting an object and the Spark source
    (`eventbus.spark.reading`) all read segments through it.

    Checks the Parquet structure and page checksums, the schema, the metadata (and that it
    matches `expect` = (topic, shard, first, last) when given, e.g. `SegmentRef.span` from the
    key), the row count, that no required column has nulls, and that entry IDs strictly increase
    within the range (on whole columns). Returns the table (the segment-schema columns, only
    `columns` if given; the ID columns are always read; typed payload columns never) and its
    info. Raises `CorruptSegment` naming `key` when any check fails: never returns wrong data.
    """
    try:
        # parsed from a copy Arrow owns, not from `data`: Arrow's worker threads release the
        # buffers they read after `read` returns, and a Python-owned one needs the GIL for that,
        # which a thread cannot take while the interpreter exits (std::terminate: exit -6 of a
        # CLI that failed on a corrupt segment)
        owned = pa.allocate_buffer(len(data))
        memoryview(owned).cast("B")[:] = data
        pf = pq.ParquetFile(pa.BufferReader(owned), page_checksum_verification=True)
        schema = pf.schema_arrow
        info = read_info(schema, key)
        check_schema(schema, info, key)
        wanted = (
            list(COLUMNS)
            if columns is None
            else list(dict.fromkeys(["entry_ms", "entry_seq", *columns]))
        )
        table = pf.read(columns=wanted)
    except CorruptSegment:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on damaged files
        raise CorruptSegment(key, f"{type(exc).__name__}: {exc}") from None
    if expect is not None and (info.topic, info.shard, info.first, info.last) != expect:
        raise CorruptSegment(
            key,
            f"metadata says {info.topic}/{info.shard} {info.first}..{info.last}, "
            f"the key says {expect[0]}/{expect[1]} {expect[2]}..{expect[3]}",
        )
    if table.num_rows != info.entries:
        raise CorruptSegment(key, f"{table.num_rows} rows, metadata says {info.entries}")
    for name in table.column_names:
        if not SCHEMA.field(name).nullable and table.column(name).null_count:
            raise CorruptSegment(key, f"column {name} has nulls")
    _check_order(table, info, key)
    return table, info


def _check_order(table: pa.Table, info: SegmentInfo, key: str) -> None:
    """Raise `CorruptSegment` naming the first entry that is not after the one before it or
    lies outside ``info.first..info.last``. The order is checked on whole columns; the range on
    the first and last rows, and on a fault by bisecting the ordered prefix (never row by row)."""
    n = table.num_rows
    if n == 0:
        return
    ms = table.column("entry_ms").combine_chunks()
    seq = table.column("entry_seq").combine_chunks()

    def entry(i: int) -> EntryId:
        return EntryId(ms[i].as_py(), seq[i].as_py())

    disorder = n  # the first row not after the row before it
    if n > 1:
        a_ms, b_ms, a_seq, b_seq = (
            ms.slice(0, n - 1),
            ms.slice(1),
            seq.slice(0, n - 1),
            seq.slice(1),
        )
        after = pc.or_(
            pc.greater(b_ms, a_ms), pc.and_(pc.equal(b_ms, a_ms), pc.greater(b_seq, a_seq))
        )
        if not pc.all(after).as_py():  # where: only on a fault (`index` is the slower scan)
            disorder = pc.index(after, False).as_py() + 1
    bad = 0 if entry(0) < info.first else None
    if bad is None and (disorder < n or entry(n - 1) > info.last):
        # rows before `disorder` increase: the first one past `last`, else `disorder`
        beyond = bisect.bisect_right(range(disorder), info.last, key=entry)
        bad = beyond if beyond < n else None
    if bad is not None:
        raise CorruptSegment(
            key, f"entry {entry(bad)} out of order or outside {info.first}..{info.last}"
        )
