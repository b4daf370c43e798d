"""A run of a shard's entries as the segment schema's columns (`eventbus.tier.segment` is the
format): `entry_columns` builds them column by column from XRANGE's raw replies, no object per
entry beyond the decoded envelope (`eventbus.tier.segment_bodies`); the entries that are not
the common case go through `eventbus.protocol.codec.decode_entry` one by one, with the same
result. `eventbus.tier.segment_write` encodes them as a segment file.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import attrgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, decode_entry
from eventbus.tier.segment_bodies import _decode_all, _text
from eventbus.tier.typed import TypedPayloads


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
    is taken column by column (the lists joined in one, sliced by field: no Python step per
    entry); any other shape entry by entry."""
    n = len(fields)
    if fields and set(map(type, fields)) == {list} and set(map(len, fields)) == {6}:
        flat = list(chain.from_iterable(fields))
        if all(flat[i::6] == [name] * n for i, name in _STANDARD_NAMES):
            rids, types, datas = flat[1::6], flat[3::6], flat[5::6]
            size = n * 11 + sum(map(len, rids)) + sum(map(len, types)) + sum(map(len, datas))
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


# what publishers write, in XADD's order: (position in the flat list, name)
_STANDARD_NAMES = ((0, F_RESOURCE), (2, F_TYPE), (4, F_DATA))


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


def _binary(values: list[bytes]) -> Any:
    """`values` (none missing) as a binary array, built from their joined bytes and offsets
    (a copy per value in C, not a conversion per value: a third of the time)."""
    joined = b"".join(values)
    if len(joined) >= 2**31:  # past int32 offsets (a segment is far smaller)
        return pa.array(values, pa.binary())
    offsets = array.array("i", accumulate(map(len, values), initial=0))
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(joined)]
    return pa.Array.from_buffers(pa.binary(), len(values), buffers)


def _texts(values: list[bytes]) -> Any:
    """UTF-8 bytes (none missing) as a string array; None if some are not UTF-8."""
    try:
        return _binary(values).cast(pa.string())
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
    rid_text = type_text = None
    if bodies is not None:  # then no rid, type or data is missing
        rid_text, type_text = _texts(rids), _texts(types)
    if bodies is None or rid_text is None or type_text is None:
        return _entry_by_entry(topic, shard, ms, seq, rids, types, datas, raw_bytes, typed)
    heads = list(map(_HEADERS, bodies))
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
        pa.array(list(map(_TIME, bodies)), pa.int64()),
        _uuid_text(list(map(_EVENT_ID, bodies))),
        _map_array(offsets, None, keys, values),
        _binary(datas),
    ]
    if typed is None:
        return EntryColumns(arrays, raw_bytes)
    struct, errors = typed.columns_of(list(map(_PAYLOAD, bodies)), type_text)
    return EntryColumns(arrays, raw_bytes, struct, errors, bodies, datas)


_HEADERS, _TIME, _EVENT_ID, _PAYLOAD = map(attrgetter, ("h", "ts", "id", "p"))


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
