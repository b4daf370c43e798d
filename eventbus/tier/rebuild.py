"""The ``data`` column of a typed segment rebuilt from its other columns.

An entry's ``data`` (format ``0x01``: `eventbus.protocol.codec`) is the MessagePack map
``{v, id, ts, h, p}``; a typed segment holds ``id``, ``ts`` and ``h`` in its envelope columns and,
for an entry of a modelled type, ``p`` in its typed columns. `rebuild` encodes the envelope again
from those columns, the same way the publisher did (`encode_entry`): the payload as the map of
its model's fields, in declaration order, each column's value as Arrow gives it. The offloader
keeps an entry's ``data`` in the file only where the rebuilt bytes differ from it (checked per
entry when it writes: `unneeded`), so every reader gets back the very bytes that were in Redis.

Only models whose fields all have JSON-native Arrow types (`rebuildable`: int64, float64, bool,
string, and lists and structs of those) are rebuilt; entries of other models keep their ``data``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from eventbus.protocol.codec import _ENCODER, ENVELOPE_VERSION, FORMAT_MSGPACK, _Body
from eventbus.tier import msgpack_columns
from eventbus.tier.typed import TypedPayloads, model_struct

_PREFIX = bytes([FORMAT_MSGPACK])
_NATIVE = (pa.int64(), pa.float64(), pa.bool_(), pa.string())


def _native(kind: pa.DataType) -> bool:
    """Whether Arrow's Python value of `kind` is the JSON-mode value pydantic dumps."""
    if pa.types.is_struct(kind):
        return all(_native(f.type) for f in kind)
    if pa.types.is_list(kind):
        return _native(kind.value_type)
    return kind in _NATIVE


def rebuildable(typed: TypedPayloads) -> dict[str, list[str]]:
    """Per event type (``"*"``: every entry) of `typed` whose model has only JSON-native
    fields (module docstring), the model's field names in declaration order: what
    ``eventbus.data_fields`` records in a segment's metadata."""
    out: dict[str, list[str]] = {}
    for key, model in typed.models.items():
        struct = model_struct(model)
        if not all(_native(f.type) for f in struct):
            continue
        names = [f.name for f in struct]
        try:  # the Struct the bodies are encoded with (a name msgspec refuses: not rebuilt)
            _payload_struct(tuple(names))
        except (TypeError, ValueError):
            continue
        out["*" if key is None else key] = names
    return out


def fields_text(fields: Mapping[str, Sequence[str]]) -> str:
    """`rebuildable`'s result as the canonical JSON of the segment metadata."""
    return json.dumps({k: list(v) for k, v in fields.items()}, sort_keys=True)


def parse_fields(text: str) -> dict[str, list[str]]:
    """The metadata text of `fields_text`. Raises `ValueError` when it is not such a JSON."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(n, str) for n in v) for v in raw.values()
    ):
        raise ValueError(f"not a map of field name lists: {text[:80]!r}")
    return {str(k): v for k, v in raw.items()}


def candidates(
    fields: Mapping[str, Sequence[str]],
    event_types: pa.Array,
    errors: pa.Array,
    columns: Mapping[str, Any],
) -> dict[str, pa.Array]:
    """Per key of `fields`, the row indexes whose ``data`` the columns may rebuild: rows of
    that event type (any, for ``"*"``) whose typed values are set (`errors` null) and whose
    envelope columns (``event_id``, ``event_time_ms``, ``headers`` in `columns`) are not null:
    an envelope `decode_entry` refused has null ones even when its payload validates."""
    ok = pc.is_null(errors)
    for name in ("event_id", "event_time_ms", "headers"):
        column = _flat(columns[name])
        if column.null_count:
            ok = pc.and_(ok, pc.is_valid(column))
    out: dict[str, pa.Array] = {}
    for key in fields:
        mask = ok if key == "*" else pc.and_(ok, pc.fill_null(pc.equal(event_types, key), False))
        idx = pc.indices_nonzero(mask)
        if len(idx):
            out[key] = idx
    return out


def rebuild(
    fields: Mapping[str, Sequence[str]],
    rows: Mapping[str, pa.Array],
    columns: Mapping[str, Any],
) -> list[tuple[pa.Array, list[bytes]]]:
    """The ``data`` bytes of the `rows` (`candidates`) from `columns` (name -> Arrow array of
    the segment: ``event_id``, ``event_time_ms``, ``headers`` and the typed columns named in
    `fields`): per key, its row indexes and their bytes, in that order. Raises `ValueError`
    when a needed envelope value is null (the columns do not describe an envelope)."""
    out = []
    for key, idx in rows.items():
        names = fields[key]
        ids = pc.take(columns["event_id"], idx)
        times = pc.take(columns["event_time_ms"], idx)
        if ids.null_count or times.null_count:
            raise ValueError("null event_id or event_time_ms on a row to rebuild")
        hexed = pc.replace_substring(ids, "-", "").to_pylist()
        id_bytes = bytes.fromhex("".join(hexed))
        if len(id_bytes) != 16 * len(idx):
            raise ValueError("an event_id is not a 16-byte UUID")
        headers = _headers(pc.take(columns["headers"], idx))
        values = [pc.take(columns[n], idx).to_pylist() for n in names]
        # a Struct of the model's fields encodes as the map of them in that order, the bytes
        # the publisher's dict gave (a dict per row costs twice as much)
        payloads = map(_payload_struct(tuple(names)), *values) if names else repeat({}, len(idx))
        body, encode = _Body, _ENCODER.encode
        bodies = [
            _PREFIX + encode(body(ENVELOPE_VERSION, id_bytes[16 * i : 16 * i + 16], ts, h, p))
            for i, (ts, h, p) in enumerate(zip(times.to_pylist(), headers, payloads, strict=True))
        ]
        out.append((idx, bodies))
    return out


def rebuild_columns(names: Sequence[str], idx: pa.Array, columns: Mapping[str, Any]) -> pa.Array:
    """`rebuild`'s bytes for the rows `idx` of one key (its typed fields `names`, each column
    `msgpack_columns.encodable`), built column by column (`eventbus.tier.msgpack_columns`)
    instead of row by row: the same bytes (tests/unit/test_rebuild.py compares them). Raises
    `ValueError` as `rebuild`."""
    every = len(idx) == len(columns["event_id"])  # all rows (idx ascending, unique): no take

    def take(name: str) -> Any:
        return columns[name] if every else pc.take(columns[name], idx)

    ids, times = take("event_id"), take("event_time_ms")
    if ids.null_count or times.null_count:
        raise ValueError("null event_id or event_time_ms on a row to rebuild")
    n = len(idx)
    hexed = pc.replace_substring(ids, "-", "")
    if n and pc.min_max(pc.binary_length(hexed)).as_py() != {"min": 32, "max": 32}:
        raise ValueError("an event_id is not a 16-byte UUID")
    hexed = hexed.combine_chunks() if isinstance(hexed, pa.ChunkedArray) else hexed
    _, offsets, values = hexed.buffers()  # every value 32 hex digits: one text, in order
    start = pa.Array.from_buffers(pa.int32(), 1, [None, offsets], offset=hexed.offset)[0]
    text = values.to_pybytes()[start.as_py() : start.as_py() + 32 * n] if n else b""
    id_bytes = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(16), n, [None, pa.py_buffer(bytes.fromhex(text.decode()))]
    ).cast(pa.binary())
    headers = take("headers")
    if headers.null_count:
        raise ValueError("null headers on a row to rebuild")
    h: Any = msgpack_columns.const(b"\x80")  # no headers: the common case
    if headers.offsets[len(headers)].as_py() != headers.offsets[0].as_py():
        h = pa.array([_ENCODER.encode(m) for m in _headers(headers)], pa.binary())
    k, c = msgpack_columns.key, msgpack_columns.const
    parts: list[Any] = [
        c(_PREFIX + b"\x85" + k("v") + _ENCODER.encode(ENVELOPE_VERSION) + k("id") + b"\xc4\x10"),
        id_bytes,
        c(k("ts")),
        msgpack_columns.encode(times),
        c(k("h")),
        h,
        c(k("p") + msgpack_columns.map_header(len(names))),
    ]
    for name in names:
        parts += [c(k(name)), msgpack_columns.encode(take(name))]
    return msgpack_columns.join(parts)


@functools.lru_cache(maxsize=256)
def _payload_struct(names: tuple[str, ...]) -> type[msgspec.Struct]:
    """A Struct with fields `names` in that order, encoded as a map (nothing omitted)."""
    return msgspec.defstruct("Payload", [(n, Any) for n in names], gc=False)


def _headers(maps: Any) -> list[dict[str, str]]:
    """A ``headers`` column as dicts, without a list per row when no row has one."""
    if isinstance(maps, pa.ChunkedArray):
        maps = maps.combine_chunks()
    if maps.null_count:
        raise ValueError("null headers on a row to rebuild")
    offsets = maps.offsets
    if offsets[0].as_py() == offsets[len(maps)].as_py():
        return list(map(dict, repeat((), len(maps))))
    return [dict(m) for m in maps.to_pylist()]


def unneeded(
    fields: Mapping[str, Sequence[str]],
    data: pa.Array,
    event_types: pa.Array,
    errors: pa.Array,
    columns: Mapping[str, Any],
) -> pa.Array:
    """`data` (binary, one value per row) with null where `rebuild` gives exactly its bytes
    back from `columns`: what a typed segment stores (format version 3)."""
    if not fields:
        return data
    rows = candidates(fields, event_types, errors, columns)
    if not rows:
        return data
    raw = data.to_pylist()
    drop = [False] * len(raw)
    for idx, bodies in rebuild(fields, rows, columns):
        for i, body in zip(idx.to_pylist(), bodies, strict=True):
            drop[i] = raw[i] == body
    if not any(drop):
        return data
    return pc.if_else(pa.array(drop, pa.bool_()), pa.nulls(len(raw), pa.binary()), data)


def restore(
    fields: Mapping[str, Sequence[str]],
    data: Any,
    event_types: Any,
    errors: Any,
    columns: Mapping[str, Any],
) -> pa.Array:
    """`data` with its nulls replaced by their rebuilt bytes (the read side of `unneeded`).
    Raises `ValueError` when a null row is not one the typed columns can rebuild."""
    data = data.combine_chunks() if isinstance(data, pa.ChunkedArray) else data
    nulls = data.null_count
    if not nulls:
        return data
    wanted = pc.is_null(data)
    rows = candidates(fields, _flat(event_types), _flat(errors), columns)
    rows = {
        k: v for k, v in ((k, pc.filter(i, pc.take(wanted, i))) for k, i in rows.items()) if len(v)
    }
    needed = {"event_id", "event_time_ms", "headers", *(n for k in rows for n in fields[k])}
    flat = {k: _flat(columns[k]) for k in needed}
    parts = []
    for key, idx in rows.items():  # by columns where they can; else entry by entry
        if all(msgpack_columns.encodable(flat[n].type) for n in fields[key]):
            parts.append((idx, rebuild_columns(fields[key], idx, flat)))
        else:
            ((_, bodies),) = rebuild(fields, {key: idx}, flat)
            parts.append((idx, pa.array(bodies, pa.binary())))
    done = sum(len(idx) for idx, _ in parts)
    if done != nulls:
        raise ValueError(f"{nulls - done} rows have neither data nor typed values to rebuild it")
    bodies = pa.concat_arrays([b for _, b in parts])
    if len(parts) > 1:  # the rows of several event types: in row order
        order = pc.sort_indices(pa.concat_arrays([idx for idx, _ in parts]))
        bodies = pc.take(bodies, order)
    if nulls == len(data):
        return bodies
    return pc.replace_with_mask(data, wanted, bodies)


def _flat(column: Any) -> Any:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
