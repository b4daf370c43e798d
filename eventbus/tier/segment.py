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
``typed_error`` (string: why a modelled entry's typed columns are null). A version-3 segment
(``rebuild_data``) leaves ``data`` null where those columns rebuild its bytes exactly
(`eventbus.tier.rebuild`, checked per entry when written); reading rebuilds it, so
every reader sees the complete column. The file's key-value metadata holds
``eventbus.segment_version`` (``1``; ``2`` for a typed segment, ``3`` for one with rebuilt
data; both also have ``eventbus.typed_models``, the models as ``{"<event type>":
"module:Name"}``, ``eventbus.typed_version``, a fingerprint of the models and their columns'
types, and ``eventbus.typed_invalid``, the entries whose payload did not validate; version 3
``eventbus.data_fields`` and ``eventbus.data_rebuilt``), ``eventbus.topic``,
``eventbus.shard``, ``eventbus.first``, ``eventbus.last`` (the range the key names),
``eventbus.entries`` and ``eventbus.raw_bytes`` (field names + values of the entries, as counted
against ``max_payload_bytes``). Data pages carry CRC32 checksums, verified on read.

Writing: `entry_columns` builds the columns of a run of entries at once (from XRANGE's raw
replies: no object per entry beyond the decoded envelope), `encode_columns` checks their order
and writes the file with per-column encodings (`_ENCODINGS`; transparent to every reader).
Reading: `eventbus.tier.segment_read` (`decode_segment`, the one reader, verifies a file).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.errors import DecodeError
from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import (
    _BODY,
    _ENCODER,
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    FORMAT_MSGPACK,
    decode_entry,
)
from eventbus.protocol.ids import EntryId
from eventbus.tier import rebuild
from eventbus.tier.typed import ERROR_COLUMN, TypedPayloads

FORMAT_VERSION = "1"
TYPED_VERSION = "2"
REBUILT_VERSION = "3"
"""A typed segment whose ``data`` is null where its other columns rebuild it exactly
(`eventbus.tier.rebuild`); its metadata adds ``eventbus.data_fields``."""

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
_DATA = len(SCHEMA) - 1
REBUILT_SCHEMA = pa.schema([*list(SCHEMA)[:_DATA], SCHEMA.field("data").with_nullable(True)])
"""`SCHEMA` of a version-3 segment: ``data`` null where rebuilt on read."""

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
    data_fields: str | None = None  # version 3: `eventbus.tier.rebuild.fields_text`
    data_rebuilt: int = 0  # version 3: entries whose ``data`` is rebuilt on read


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _map_array(offsets: Any, null: list[bool] | None, keys: list[str], values: list[str]) -> Any:
    """A map<string, string> array (built from offsets: far faster than from Python pairs)."""
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(keys, pa.string()),
        pa.array(values, pa.string()),
        mask=pa.array(null, pa.bool_()) if null is not None and any(null) else None,
    )


@dataclass(frozen=True, slots=True)
class EntryColumns:
    """A run of one shard's entries as the segment schema's columns (`arrays`, in `SCHEMA`
    order), with their raw bytes (field names + values) and, for a topic with models, the typed
    struct (`typed`) and per entry why it has no typed values (`typed_errors`)."""

    arrays: list[Any]
    raw_bytes: int
    typed: pa.StructArray | None = None
    typed_errors: list[str | None] | None = None
    bodies: list[Any] | None = None  # the decoded bodies, when decoded in one pass
    datas: list[bytes] | None = None  # their raw ``data``


Fields = Sequence[bytes] | Mapping[bytes, bytes]
"""An entry's fields: an XRANGE reply's raw list ``[name, value, ...]`` or a field map."""


def _field_lists(fields: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any], int]:
    """Per entry its ``rid``, ``type`` and ``data`` values (None where missing) and the raw bytes
    of all fields. The common shape, raw lists of exactly those three fields in XADD's order,
    is taken column by column; any other shape entry by entry."""
    if (
        fields
        and set(map(type, fields)) == {list}
        and set(map(len, fields)) == {6}
        and ({f[0] for f in fields}, {f[2] for f in fields}, {f[4] for f in fields})
        == _STANDARD_NAMES
    ):
        rids, types, datas = [f[1] for f in fields], [f[3] for f in fields], [f[5] for f in fields]
        size = len(fields) * 11 + sum(map(len, rids)) + sum(map(len, types)) + sum(map(len, datas))
        return rids, types, datas, size
    maps = [
        f if isinstance(f, Mapping) else dict(zip(f[::2], f[1::2], strict=True)) for f in fields
    ]
    size = sum(len(k) + len(v) for m in maps for k, v in m.items())
    return (
        [m.get(F_RESOURCE) for m in maps],
        [m.get(F_TYPE) for m in maps],
        [m.get(F_DATA) for m in maps],
        size,
    )


_STANDARD_NAMES = ({F_RESOURCE}, {F_TYPE}, {F_DATA})  # what publishers write, in XADD's order


def _uuid_text(ids: list[bytes]) -> Any:
    """16-byte event IDs as UUID text (``str(uuid.UUID(bytes=...))``), for all at once: the hex
    digits of all IDs copied into place with strided slices (32 copies of `n` bytes, not `n`
    Python steps), the dashes likewise."""
    n = len(ids)
    hexed = b"".join(ids).hex().encode()
    out = bytearray(36 * n)
    for src, dst in _UUID_DIGITS:
        out[dst::36] = hexed[src::32]
    for dash in (8, 13, 18, 23):
        out[dash::36] = b"-" * n
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(36), n, [None, pa.py_buffer(out)])
    return fixed.cast(pa.string())


# where each hex digit of an ID goes in its 36 characters: 8-4-4-4-12 with dashes between
_UUID_DIGITS = [(i, i + sum(i >= edge for edge in (8, 12, 16, 20))) for i in range(32)]


class _Head(msgspec.Struct, gc=False):
    """`eventbus.protocol.codec._Body` with the payload left as its MessagePack bytes: the
    same checks of the envelope's own fields, the payload's structure walked but not built (an
    untyped segment needs no payload objects; its strings are not decoded)."""

    v: Literal[1]
    id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    ts: int
    h: dict[str, str]
    p: msgspec.Raw


_DECODE_HEAD = msgspec.msgpack.Decoder(_Head).decode
_DECODE_BODY = _BODY.decode


def _decode_all(
    rids: list[Any], types: list[Any], datas: list[Any], typed: TypedPayloads | None
) -> list[Any] | None:
    """The envelope bodies of all entries in one pass (with `typed`, their payloads decoded,
    into the model's msgspec mirror where the page has one model that has one
    (`TypedPayloads.mirrors`): validated in the same pass; else as raw bytes), when every entry
    is the common case `decode_entry` decodes in one typed pass (``rid`` and ``type`` present,
    format ``0x01``, at most `MIN_CONTAINERS` bytes); None when any entry is not (or does not
    decode): then each goes through `decode_entry`."""
    if None in rids or None in types or None in datas:
        return None
    if {d[:1] for d in datas} != {_PLAIN} or max(map(len, datas)) > MIN_CONTAINERS:
        return None
    mirrored = None if typed is None else _mirror_decoder(typed, types)
    decode = _DECODE_HEAD if typed is None else (mirrored or _DECODE_BODY)
    try:
        return [decode(d[1:]) for d in datas]
    # a payload string that is not UTF-8, or nesting past msgspec's depth (a poison entry):
    # each entry then goes through `decode_entry`, which makes either its own DecodeError
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        if mirrored is None:
            return None
    try:  # some payload is not the mirror's (pydantic validates it): entry by entry
        return [_decode_either(mirrored, d[1:]) for d in datas]
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return None


def _decode_either(mirrored: Any, body: bytes) -> Any:
    try:
        return mirrored(body)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return _DECODE_BODY(body)


def _mirror_decoder(typed: TypedPayloads, types: list[bytes]) -> Any:
    """The decoder of bodies whose payload is the mirror of the one model of every entry of
    `types` (None: the entries have several models, or theirs has no mirror)."""
    if typed.any_type:
        key = None
    else:
        kinds = set(types)
        if len(kinds) != 1:
            return None
        key = _text(kinds.pop())
        if key not in typed.models:
            return None
    mirror = typed.mirrors[key]
    return None if mirror is None else _mirrored_body(mirror)


@functools.lru_cache(maxsize=64)
def _mirrored_body(mirror: type[msgspec.Struct]) -> Any:
    """`codec._Body`'s decoder with the payload typed as `mirror`."""
    body = msgspec.defstruct(
        "Body",
        [
            ("v", Literal[1]),
            ("id", Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]),
            ("ts", int),
            ("h", dict[str, str]),
            ("p", mirror),
        ],
        gc=False,
    )
    return msgspec.msgpack.Decoder(body).decode


_PLAIN = bytes([FORMAT_MSGPACK])


def _texts(values: list[Any]) -> Any:
    """UTF-8 bytes as a string array, null where missing; None if some are not UTF-8."""
    try:
        return pa.array(values, pa.binary()).cast(pa.string())
    except pa.ArrowInvalid:
        return None


def entry_columns(
    topic: str,
    shard: int,
    ids: Sequence[bytes | str],
    fields: Sequence[Fields],
    typed: TypedPayloads | None = None,
) -> EntryColumns:
    """Entries (their IDs ``<ms>-<seq>`` and fields, as XRANGE gives them) as the segment
    schema's columns, built column by column: envelope columns null where the envelope does not
    decode; with `typed`, the payloads validated once per model (`TypedPayloads.validate`).
    Entries that are not the common case (`_decode_all`) are decoded one by one with
    `decode_entry`, with the same result. Raises `ValueError` for an ID that is not ``ms-seq``
    of integers (int64)."""
    n = len(ids)
    rids, types, datas, raw_bytes = _field_lists(fields)
    id_text = pa.array(ids, pa.binary() if n and isinstance(ids[0], bytes) else pa.string())
    try:
        parts = pc.split_pattern(id_text.cast(pa.string()), "-", max_splits=1)
        ms = pc.list_element(parts, 0).cast(pa.int64())
        seq = pc.list_element(parts, 1).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ValueError(f"entry IDs of {topic}/{shard} are not <ms>-<seq>: {exc}") from None
    bodies = _decode_all(rids, types, datas, typed)
    rid_text, type_text = _texts(rids), _texts(types)
    if bodies is None or rid_text is None or type_text is None:
        return _entry_by_entry(topic, shard, ms, seq, rids, types, datas, raw_bytes, typed)
    heads = [b.h for b in bodies]
    if any(heads):
        lengths = pa.array([len(h) for h in heads], pa.int32())
        offsets: Any = pa.concat_arrays([pa.array([0], pa.int32()), pc.cumulative_sum(lengths)])
        keys = [k for h in heads for k in h]
        values = [v for h in heads for v in h.values()]
    else:
        offsets, keys, values = _zeros(n + 1), [], []
    arrays = [
        *_fixed(topic, shard, n),
        pc.binary_join_element_wise(ms.cast(pa.string()), seq.cast(pa.string()), "-"),
        ms,
        seq,
        rid_text,
        type_text,
        pa.array([b.ts for b in bodies], pa.int64()),
        _uuid_text([b.id for b in bodies]),
        _map_array(offsets, None, keys, values),
        pa.array(datas, pa.binary()),
    ]
    if typed is None:
        return EntryColumns(arrays, raw_bytes)
    struct, errors = typed.columns_of([b.p for b in bodies], type_text)
    return EntryColumns(arrays, raw_bytes, struct, errors, bodies, datas)


def _zeros(n: int) -> Any:
    """`n` int32 zeros, made from a zeroed buffer (no Python list of `n` items)."""
    return pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(bytes(4 * n))])


def _fixed(topic: str, shard: int, n: int) -> list[Any]:
    """The ``topic`` and ``shard`` columns of `n` entries."""
    return [
        pa.DictionaryArray.from_arrays(_zeros(n), pa.array([topic])),
        pc.add(_zeros(n), pa.scalar(shard, pa.int32())),
    ]


def _entry_by_entry(
    topic: str,
    shard: int,
    ms: Any,
    seq: Any,
    rids: list[Any],
    types: list[Any],
    datas: list[Any],
    raw_bytes: int,
    typed: TypedPayloads | None,
) -> EntryColumns:
    """`entry_columns` for entries some of which are not the common case: `decode_entry` on
    each (null envelope columns where it raises `DecodeError`)."""
    cols: dict[str, list[Any]] = {"event_time_ms": [], "event_id": []}
    header_keys: list[str] = []
    header_values: list[str] = []
    header_offsets: list[int] = [0]
    header_null: list[bool] = []  # a null map: the envelope did not decode
    datas = [b"" if d is None else d for d in datas]
    for rid, etype, data in zip(rids, types, datas, strict=True):
        fields = {F_DATA: data}
        if rid is not None:
            fields[F_RESOURCE] = rid
        if etype is not None:
            fields[F_TYPE] = etype
        try:
            env = decode_entry(fields)
        except (DecodeError, UnicodeDecodeError):  # decode_entry lets the latter through
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
    type_texts = [_text(t) for t in types]
    arrays = [
        *_fixed(topic, shard, len(datas)),
        pc.binary_join_element_wise(ms.cast(pa.string()), seq.cast(pa.string()), "-"),
        ms,
        seq,
        pa.array([_text(r) for r in rids], pa.string()),
        pa.array(type_texts, pa.string()),
        pa.array(cols["event_time_ms"], pa.int64()),
        pa.array(cols["event_id"], pa.string()),
        _map_array(header_offsets, header_null, header_keys, header_values),
        pa.array(datas, pa.binary()),
    ]
    if typed is None:
        return EntryColumns(arrays, raw_bytes)
    struct, errors = typed.columns(datas, type_texts)
    return EntryColumns(arrays, raw_bytes, struct, errors)


def entry_arrays(topic: str, shard: int, entries: Sequence[RawEntry]) -> list[Any]:
    """`entries` (ID, field map) as the segment schema's columns, in `SCHEMA` order: envelope
    columns null where the envelope does not decode (`entry_columns`). Used by readers of the
    Redis tail that must give the same rows as segments (`eventbus.spark`)."""
    return entry_columns(topic, shard, [str(i) for i, _ in entries], [f for _, f in entries]).arrays


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
    version = FORMAT_VERSION if typed is None else TYPED_VERSION
    if info.data_fields is not None:
        version = REBUILT_VERSION
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
    again = list(map(_ENCODER.encode, bodies))
    if _PLAIN + _PLAIN.join(again) == b"".join(datas):  # the common case: all, at once
        return [True] * len(datas)
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


def _after_previous(ms: Any, seq: Any) -> Any:
    """For rows 1..n-1 of the entry-ID columns `ms`, `seq` (n >= 2): whether each row's ID is
    after the previous row's (a boolean array of n - 1)."""
    n = len(ms)
    a_ms, b_ms, a_seq, b_seq = ms.slice(0, n - 1), ms.slice(1), seq.slice(0, n - 1), seq.slice(1)
    return pc.or_(pc.greater(b_ms, a_ms), pc.and_(pc.equal(b_ms, a_ms), pc.greater(b_seq, a_seq)))
