"""Read-schema batches for Spark: fixed columns by vectorised casts, typed payload columns.

`Converter` takes Arrow record batches of the segment schema (`eventbus.tier.segment.SCHEMA`),
whether the rows came from a segment or from ``XRANGE`` (`eventbus.spark.reading`), and returns
batches of the read schema (`eventbus.spark.schema`); only payload decoding (with a model)
touches rows one by one.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, TypeAdapter, ValidationError

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, FORMAT_MSGPACK, decode_entry
from eventbus.spark.schema import BASE_NAMES, CORRUPT

BATCH_ROWS = 32768


class Converter:
    """Turns segment-schema batches into read-schema batches (`target`, Spark's Arrow schema).

    `models`: None (raw read) or event type -> model (key None: every entry). `mode`:
    ``PERMISSIVE`` (undecodable payload -> ``_corrupt``) or ``FAILFAST`` (raise `DecodeError`).
    `validate`: validate with pydantic (default); False converts the payload maps straight to
    Arrow (faster; validators and constraints do not run; a batch that does not convert falls
    back to pydantic).
    """

    def __init__(
        self,
        target: pa.Schema,
        models: Mapping[str | None, type[BaseModel]] | None,
        mode: str = "PERMISSIVE",
        validate: bool = True,
    ) -> None:
        self.target = target
        self.models = dict(models or {})
        self.failfast = mode == "FAILFAST"
        self.validate = validate
        self.typed_names = [n for n in target.names if n not in BASE_NAMES and n != CORRUPT]
        self.typed_type = pa.struct([target.field(n) for n in self.typed_names])
        # models whose fields are all scalars Arrow takes as they are: `__dict__` is the row
        self.flat = {k: _flat(m) for k, m in self.models.items()}
        self.adapters = {
            k: TypeAdapter(list[m])  # type: ignore[valid-type]
            for k, m in self.models.items()
        }

    def convert(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """One read-schema batch for one segment-schema batch (same rows, same order)."""
        n = batch.num_rows
        published = batch.column("event_time_ms")
        published = pc.multiply(published, pa.scalar(1000, pa.int64())).cast(
            pa.timestamp("us", tz="UTC")
        )
        topic = batch.column("topic")
        if pa.types.is_dictionary(topic.type):
            topic = topic.dictionary_decode()
        base = {
            "topic": topic,
            "shard": batch.column("shard"),
            "entry_id": batch.column("entry_id"),
            "entry_ms": batch.column("entry_ms"),
            "entry_seq": batch.column("entry_seq"),
            "resource_id": batch.column("resource_id"),
            "event_type": batch.column("event_type"),
            "event_id": batch.column("event_id"),
            "published_at": published,
            "headers": batch.column("headers"),
            "payload": batch.column("data"),
        }
        corrupt: list[str | None] | None = None
        typed: dict[str, Any] = {}
        if self.models:
            typed, corrupt = self._typed(batch)
        arrays = []
        for field in self.target:
            if field.name in base:
                arrays.append(base[field.name].cast(field.type))
            elif field.name == CORRUPT:
                arrays.append(pa.array(corrupt if corrupt else [None] * n, pa.string()))
            else:
                arrays.append(typed[field.name].cast(field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.target)

    def _typed(self, batch: pa.RecordBatch) -> tuple[dict[str, Any], list[str | None] | None]:
        data = batch.column("data").to_pylist()
        n = len(data)
        any_type = None in self.models
        types = [None] * n if any_type else batch.column("event_type").to_pylist()
        corrupt: list[str | None] = [None] * n
        groups: dict[str | None, list[int]] = {}
        payloads: list[Any] = [None] * n
        for i, (raw, etype) in enumerate(zip(data, types, strict=True)):
            if not any_type and etype not in self.models:
                continue
            try:
                payloads[i] = _payload(raw)
            except DecodeError as exc:
                corrupt[i] = f"DecodeError: {exc}"
                continue
            groups.setdefault(etype, []).append(i)
        struct = None
        if not self.validate:  # payload maps straight to Arrow, if they all convert
            try:
                struct = pa.array(payloads, self.typed_type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                struct = None
        if struct is None:
            rows: list[dict[str, Any] | None] = [None] * n
            for key, idx in groups.items():
                self._validate(key, idx, payloads, rows, corrupt)
            struct = pa.array(rows, self.typed_type)
        if self.failfast and any(c is not None for c in corrupt):
            i = next(i for i, c in enumerate(corrupt) if c is not None)
            entry = batch.column("entry_id")[i].as_py()
            raise DecodeError(f"entry {entry} of shard {batch.column('shard')[i]}: {corrupt[i]}")
        cols = dict(zip(self.typed_names, struct.flatten(), strict=True))
        return cols, corrupt if any(c is not None for c in corrupt) else None

    def _validate(
        self,
        key: str | None,
        idx: list[int],
        payloads: list[Any],
        rows: list[dict[str, Any] | None],
        corrupt: list[str | None],
    ) -> None:
        """Validate the payloads at `idx` with the model of `key` into `rows` (one list
        validation; one by one only when it fails, to tell the bad rows apart)."""
        model = self.models[key]
        try:
            models: list[BaseModel] = self.adapters[key].validate_python([payloads[i] for i in idx])
        except ValidationError:
            for i in idx:
                try:
                    rows[i] = _row(model.model_validate(payloads[i]))
                except ValidationError as exc:
                    corrupt[i] = f"ValidationError: {model.__name__}: {_short(exc)}"
            return
        if self.flat[key]:
            for i, m in zip(idx, models, strict=True):
                rows[i] = m.__dict__
        else:
            for i, m in zip(idx, models, strict=True):
                rows[i] = _row(m)


def _payload(raw: bytes) -> Any:
    """The payload (``p``) of an envelope; msgpack-only envelopes without the `Envelope` object
    (the common case), others through `decode_entry`. Raises `DecodeError`."""
    if raw and raw[0] == FORMAT_MSGPACK:
        try:
            env = msgpack.unpackb(memoryview(raw)[1:], raw=False, strict_map_key=True)
            return env["p"]
        except Exception as exc:
            raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None
    return decode_entry({F_RESOURCE: b"-", F_TYPE: b"-", F_DATA: raw}).payload


_SCALARS = (str, int, float, bool, bytes, dt.datetime, dt.date)


def _flat(model: type[BaseModel]) -> bool:
    """Whether every field of `model` is a scalar (or an optional one) that Arrow converts as
    validated: ``str``, ``int``, ``float``, ``bool``, ``bytes``, ``datetime``, ``date`` (not a
    subclass such as an enum)."""
    for field in model.model_fields.values():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        if ann not in _SCALARS:
            return False
    return True


def _row(model: BaseModel) -> dict[str, Any]:
    """A validated model as a dict Arrow converts: plain fields as they are; nested models as
    dicts, enums as their values, UUIDs and decimals as text."""
    d = model.__dict__
    if all(type(v) in _PLAIN for v in d.values()):
        return d
    return {k: _plain(v) for k, v in d.items()}


def _plain(value: Any) -> Any:
    if type(value) in _PLAIN or isinstance(value, dt.date):
        return value
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, v in value.__dict__.items()}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    return json.dumps(value, default=str)


_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
