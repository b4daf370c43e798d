"""Typed replay from a segment's typed columns (`eventbus.tier.typed`), without decoding the
entry's MessagePack body nor validating its payload, where that provably gives what
`Model.model_validate(payload)` gives (`eventbus.tier.replay.iter_events`).

Three conditions, all checked:

* the model (`constructible`): a `mirror_struct` model of `eventbus.tier.typed` (fields
  ``int``, ``float``, ``str``, ``bool`` or one of them or None, no validators, constraints,
  aliases, default factories, post-init or configuration that changes validation) with no
  defaults at all, no ``extra="allow"`` and no private attributes: validating a dict holding
  exactly its fields, each value of the field's type (None only where the field allows it),
  gives a model whose ``__dict__`` is that dict, every field set, no extra, no private state;
* the segment (`ColumnReplay.usable`): its ``eventbus.typed_models`` names the model for the
  event type (or for every type) as ``module:QualName``, its ``eventbus.typed_version``
  fingerprints those models and the typed columns the file holds, and the model's fields are
  among them with the Arrow types `model_struct` gives them;
* the entry (`TypedBatch`): its ``data`` bytes equal, byte for byte, the envelope rebuilt from
  its envelope and typed columns (`eventbus.tier.rebuild.rebuild_columns`: the map of the
  model's fields in declaration order): so the payload is exactly the dict of those columns'
  values, and the envelope what `decode_entry` gives; no ``typed_error``, no null where the
  field is not optional, and short enough for `decode_entry`'s one-pass decode.

Every other entry is validated from its payload as before (`eventbus.tier.replay_events`).
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from msgspec.structs import asdict
from pydantic import BaseModel

from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import Envelope
from eventbus.tier import rebuild
from eventbus.tier.archived import EntryBatch, ReplayFilter, _filtered
from eventbus.tier.gc_pause import paused_gc
from eventbus.tier.layout import SegmentRef
from eventbus.tier.rebuild import _payload_struct, rebuild_columns
from eventbus.tier.replay_events import ReplayedEvent
from eventbus.tier.segment import SCHEMA, SegmentInfo
from eventbus.tier.segment_read import REBUILT_ROWS, decode_segment_batches
from eventbus.tier.typed import ERROR_COLUMN, model_struct
from eventbus.tier.typed_mirror import mirror_struct

_SET_DICT = object.__setattr__
_SLOTS = {name: BaseModel.__dict__[name].__set__ for name in BaseModel.__slots__}


@dataclass(frozen=True)
class Fields:
    """A `constructible` model's fields: names in declaration order, their Arrow types, and
    the names of those that do not allow None."""

    names: tuple[str, ...]
    types: tuple[pa.DataType, ...]
    required: tuple[str, ...]


def constructible(model: type[BaseModel]) -> Fields | None:
    """`model`'s `Fields` when a model built from an exact payload dict without validation
    equals the validated one (module docstring), else None."""
    if mirror_struct(model) is None:
        return None
    if model.model_config.get("extra") == "allow" or model.__private_attributes__:
        return None
    fields = model.model_fields
    if not all(f.is_required() for f in fields.values()):
        return None
    struct = model_struct(model)
    required = tuple(n for n, f in fields.items() if not _optional(f.annotation))
    return Fields(tuple(struct.names), tuple(f.type for f in struct), required)


def _optional(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(annotation)


class ColumnReplay:
    """The replaying models (event type -> model) whose entries may be built from typed
    columns, and the reading of a segment that does it (`open_batches`)."""

    def __init__(self, models: Mapping[str, type[BaseModel]]) -> None:
        self.models = dict(models)
        self.fields = {t: f for t, m in self.models.items() if (f := constructible(m))}

    def usable(self, info: SegmentInfo, schema: pa.Schema) -> dict[str, Fields]:
        """Per event type, the `Fields` whose columns this segment holds for the same model
        (module docstring); empty for an untyped segment or one written for other models."""
        if not self.fields or info.typed_models is None or info.typed_version is None:
            return {}
        try:
            spec = json.loads(info.typed_models)
        except ValueError:
            return {}
        typed = list(schema)[len(SCHEMA) : -1]  # between ``data`` and ``typed_error``
        fingerprint = f"{info.typed_models}\n{pa.struct(typed)}".encode()
        if not isinstance(spec, dict) or (
            hashlib.sha256(fingerprint).hexdigest()[:16] != info.typed_version
        ):
            return {}
        have = {f.name: f.type for f in typed}
        out = {}
        for etype, fields in self.fields.items():
            model = self.models[etype]
            if spec.get(etype, spec.get("*")) != f"{model.__module__}:{model.__qualname__}":
                continue
            if all(have.get(n) == t for n, t in zip(fields.names, fields.types, strict=True)):
                out[etype] = fields
        return out

    def open_batches(
        self, data: bytes, ref: SegmentRef, flt: ReplayFilter, rows: int
    ) -> tuple[int, Iterator[EntryBatch]]:
        """`eventbus.tier.archived.open_batches`, with the typed columns of the `usable`
        types read too, each batch a `TypedBatch` where the segment has some."""
        found: dict[str, Fields] = {}
        exact: set[str] = set()

        def extra(info: SegmentInfo, schema: pa.Schema) -> list[str]:
            found.update(self.usable(info, schema))
            exact.update(_rebuilt_as(info, found))
            names = (n for f in found.values() for n in f.names)
            return [*dict.fromkeys(names), ERROR_COLUMN] if found else []

        info, tables = decode_segment_batches(
            data, ref.key, expect=ref.span, batch_rows=rows, extra=extra
        )
        return info.entries, self._matching(tables, info, ref, flt, found, exact)

    def _matching(
        self,
        tables: Iterator[pa.Table],
        info: SegmentInfo,
        ref: SegmentRef,
        flt: ReplayFilter,
        found: dict[str, Fields],
        exact: set[str],
    ) -> Iterator[EntryBatch]:
        for table in tables:
            table = _filtered(table, flt, ref).combine_chunks()
            if not table.num_rows:
                continue
            if found:
                kinds = _kinds(table, found, exact)
                table = table.drop_columns([c for c in (REBUILT_ROWS,) if c in table.column_names])
                yield TypedBatch(table, info.topic, info.shard, ref.key, self, found, kinds)
            else:
                yield EntryBatch(table, info.topic, info.shard, ref.key)


class TypedBatch(EntryBatch):
    """An `EntryBatch` whose `entries` are `ReplayedEvent`s built from the typed columns for
    the rows that may be (module docstring: `kinds`, checked as the batch is made, in the
    decoding thread) and `ArchivedEntry`s for the others (validated from their payloads)."""

    __slots__ = ("found", "kinds", "replay")

    def __init__(
        self,
        rows: pa.Table,
        topic: str,
        shard: int,
        segment: str,
        replay: ColumnReplay,
        found: dict[str, Fields],
        kinds: list[str | None] | None = None,
    ) -> None:
        super().__init__(rows, topic, shard, segment)
        self.replay, self.found = replay, found
        self.kinds = kinds if kinds is not None else _kinds(rows, found, set())

    def slice(self, start: int, stop: int) -> EntryBatch:
        """Rows ``start:stop`` (no copy of the columns)."""
        return TypedBatch(
            self.rows.slice(start, stop - start),
            self.topic,
            self.shard,
            self.segment,
            self.replay,
            self.found,
            self.kinds[start:stop],
        )

    def entries(self, start: int = 0, stop: int | None = None) -> list[Any]:
        """Rows ``start:stop``: `ReplayedEvent`s where `kinds` names a type, else
        `ArchivedEntry`s. Raises `CorruptSegment` for an ``event_id`` that is not a UUID."""
        stop = self.n if stop is None else stop
        kinds = self.kinds[start:stop]
        rows = self.rows.slice(start, stop - start)
        with paused_gc():  # (one pause: a collection between the two parts costs 5 %)
            out: list[Any] = super().entries(start, stop)
            for etype, fields in self.found.items():
                at = [i for i, k in enumerate(kinds) if k == etype]
                if at:
                    every = len(at) == len(kinds)
                    _built(out, at, rows, fields, self.replay.models[etype], every)
        return out


def _rebuilt_as(info: SegmentInfo, found: dict[str, Fields]) -> list[str]:
    """The types of `found` whose rebuilt ``data`` (version 3: `eventbus.tier.rebuild`) is the
    map of exactly their fields in declaration order: a row whose ``data`` was rebuilt needs
    no comparison."""
    if info.data_fields is None:
        return []
    fields = rebuild.parse_fields(info.data_fields)
    out = []
    for etype, f in found.items():
        keys = [k for k in (etype, "*") if k in fields]
        if len(keys) == 1 and tuple(fields[keys[0]]) == f.names:
            out.append(etype)
    return out


def _kinds(rows: pa.Table, found: dict[str, Fields], exact: set[str]) -> list[str | None]:
    """Per row, the event type whose model builds it from the columns (module docstring), or
    None. Rows of an `exact` type whose ``data`` was rebuilt (`REBUILT_ROWS`) are the
    rebuilt bytes already; the others are compared with them."""
    n = rows.num_rows
    columns = {name: rows.column(name).combine_chunks() for name in rows.column_names}
    base = pc.and_(
        pc.is_null(columns[ERROR_COLUMN]),
        pc.less_equal(pc.binary_length(columns["data"]), MIN_CONTAINERS),
    )
    for name in ("resource_id", "event_id", "event_time_ms", "headers"):
        if columns[name].null_count:
            base = pc.and_(base, pc.is_valid(columns[name]))
    kinds: list[str | None] = [None] * n
    for etype, fields in found.items():
        mask = pc.and_(base, pc.fill_null(pc.equal(columns["event_type"], etype), False))
        for name in fields.required:
            if columns[name].null_count:
                mask = pc.and_(mask, pc.is_valid(columns[name]))
        if etype in exact and REBUILT_ROWS in columns:
            done = pc.and_(mask, columns[REBUILT_ROWS])
            for i in pc.indices_nonzero(done).to_pylist():
                kinds[i] = etype
            mask = pc.and_(mask, pc.invert(columns[REBUILT_ROWS]))
        idx = pc.indices_nonzero(mask)
        if not len(idx):
            continue
        try:
            rebuilt = rebuild_columns(fields.names, idx, columns)
        except ValueError:  # an event ID that is no 16-byte UUID: validated from `data`
            continue
        same = pc.equal(rebuilt, pc.take(columns["data"], idx))
        for i in pc.filter(idx, same).to_pylist():
            kinds[i] = etype
    return kinds


def _built(
    out: list[Any],
    at: list[int],
    rows: pa.Table,
    fields: Fields,
    model: type[BaseModel],
    every: bool,
) -> None:
    """Replace ``out[i]`` (an `ArchivedEntry`) for each row `i` of `at` by its `ReplayedEvent`:
    the payload the dict of the typed columns, the event that dict as the model's fields."""
    taken = rows if every else rows.take(at)
    values = [taken.column(name).to_pylist() for name in fields.names]
    # a Struct per row, then its dict: both in C (dict(zip(...)) per row: 1.2 x the time)
    payloads = list(map(asdict, map(_payload_struct(fields.names), *values)))
    entries = out if every else [out[i] for i in at]
    envelopes = list(
        map(
            Envelope,
            [e.resource_id for e in entries],
            [e.event_type for e in entries],
            [e.event_id.bytes for e in entries],
            [e.published_at_ms for e in entries],
            [dict(e.headers) for e in entries],
            payloads,
        )
    )
    events = list(map(object.__new__, repeat(model, len(payloads))))
    n = len(events)
    list(map(_SET_DICT, events, repeat("__dict__", n), map(dict.copy, payloads)))
    names = set(fields.names)
    list(map(_SLOTS["__pydantic_fields_set__"], events, map(set.copy, repeat(names, n))))
    list(map(_SLOTS["__pydantic_extra__"], events, repeat(None, n)))
    list(map(_SLOTS["__pydantic_private__"], events, repeat(None, n)))
    made = list(map(ReplayedEvent, events, envelopes, entries))
    if every:
        out[:] = made
    else:
        for i, r in zip(at, made, strict=True):
            out[i] = r
