"""Typed payload columns: pydantic models mapped to Arrow, and payloads validated into them.

A topic's registered models (``EVENTBUS_TIER_TYPED_MODELS``, or ``format("eventbus")``'s
``model`` option) give the columns: the union of the models' fields, by field name, typed by
`arrow_type` (docs/protocol.md has the table). The offloader writes them next to the raw ``data``
column (`eventbus.tier.segment_write.encode_segment`), the Spark source builds the same values from
``data`` when a segment lacks them (`eventbus.spark.decode`). ``data`` stays the source of truth.
"""

from __future__ import annotations

import ast
import datetime as dt
import decimal
import enum
import hashlib
import importlib
import json
import types
import typing
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import msgspec
import pyarrow as pa
from pydantic import BaseModel, TypeAdapter, ValidationError

from eventbus.errors import ConfigError, DecodeError, cut, shown
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, FORMAT_MSGPACK, decode_entry
from eventbus.tier.typed_mirror import _flat, mirror_struct

ERROR_COLUMN = "typed_error"
"""Segment column: why an entry of a modelled type has null typed columns (else null)."""

RESERVED = frozenset(
    {
        # segment columns (`eventbus.tier.segment.SCHEMA`) and the Spark read's fixed columns
        *("topic", "shard", "entry_id", "entry_ms", "entry_seq", "resource_id", "event_type"),
        *("event_time_ms", "event_id", "headers", "data", "published_at", "payload"),
        *("_corrupt", ERROR_COLUMN),
    }
)
UTC_MICROS = pa.timestamp("us", tz="UTC")
Models = Mapping[str | None, type[BaseModel]]
"""Event type -> model; the key None: one model for every entry."""


def load_object(path: str, what: str) -> Any:
    """Import ``"pkg.module:Name"``. Raises `ConfigError` naming `what` and the path."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"{what} must be 'package.module:Name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # whatever the module raises at import, not only ImportError
        reason = cut(f"{type(exc).__name__}: {exc}")
        raise ConfigError(f"cannot import {what} {path!r}: {reason}") from None
    return obj


def load_models(spec: str | None, what: str = "model") -> dict[str | None, Any] | None:
    """A model spec: ``"pkg.mod:Model"`` (key None: decodes every entry) or a JSON object
    ``{"<event type>": "pkg.mod:Model", ...}`` (entries of other types get null typed columns).
    Raises `ConfigError` naming `what`."""
    if not spec:
        return None
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as exc:
            try:  # .option("model", {...}) hands Spark str(dict): Python's quoting
                raw = ast.literal_eval(spec)
            except (ValueError, SyntaxError):
                raise ConfigError(f"option {what} is not a JSON object: {exc}") from None
        pairs: dict[str | None, Any] = {str(k): load_object(str(v), what) for k, v in raw.items()}
    else:
        pairs = {None: load_object(spec, what)}
    for model in pairs.values():
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"option {what} must name pydantic models, got {shown(model)}")
    return pairs


_SCALARS: dict[type, pa.DataType] = {
    bool: pa.bool_(),  # before int: bool is an int
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bytes: pa.binary(),
    dt.datetime: UTC_MICROS,  # before date: a datetime is a date
    dt.date: pa.date32(),
}


def arrow_type(annotation: Any) -> pa.DataType:
    """The Arrow type of a pydantic field annotation (docs/protocol.md, "Typed columns").

    ``X | None`` is X (nullable); ``int`` int64; ``float`` float64; ``datetime`` timestamp[us,
    UTC]; ``date`` date32; ``list[X]``/``tuple``/``set`` list; ``dict[str, X]`` map; a model a
    struct; an enum or ``Literal`` the type of its values; UUID, Decimal, other unions and
    anything else string (UUID and Decimal as text, other values as JSON text).
    """
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return arrow_type(args[0]) if len(args) == 1 else pa.string()
    if origin is typing.Annotated:
        return arrow_type(args[0])
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        return arrow_type(kinds.pop()) if len(kinds) == 1 else pa.string()
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return pa.list_(arrow_type(inner[0]) if len(set(inner)) == 1 else pa.string())
    if origin in (dict, Mapping):
        return pa.map_(pa.string(), arrow_type(args[1]) if len(args) == 2 else pa.string())
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return model_struct(annotation)
        if issubclass(annotation, enum.Enum):
            kinds = {type(m.value) for m in annotation}
            return _SCALARS.get(kinds.pop(), pa.string()) if len(kinds) == 1 else pa.string()
        for py, arrow in _SCALARS.items():
            if issubclass(annotation, py):
                return arrow
    return pa.string()


def model_struct(model: type[BaseModel]) -> pa.StructType:
    """A struct with one field per field of `model` (by field name, in declaration order)."""
    return pa.struct([(name, arrow_type(f.annotation)) for name, f in model.model_fields.items()])


def typed_struct(models: Models) -> pa.StructType:
    """The union of the models' fields, in first-seen order. Raises `ConfigError` when two
    models give one field name two types, or a field name is a fixed column's (`RESERVED`)."""
    out: dict[str, pa.Field] = {}
    for model in models.values():
        for field in model_struct(model):
            if field.name in RESERVED:
                raise ConfigError(
                    f"model {model.__name__} has a field {field.name!r}, the name of a fixed "
                    "column of segments and of the eventbus source; rename the field (or alias "
                    "it)"
                )
            seen = out.get(field.name)
            if seen is not None and seen.type != field.type:
                raise ConfigError(
                    f"field {field.name!r} is {seen.type} in one model and {field.type} in "
                    f"{model.__name__}"
                )
            out.setdefault(field.name, field)
    return pa.struct(list(out.values()))


def models_spec(models: Models) -> str:
    """The models as canonical JSON ``{"<event type>" or "*": "module:QualName"}``."""
    return json.dumps(
        {k or "*": f"{m.__module__}:{m.__qualname__}" for k, m in models.items()}, sort_keys=True
    )


class TypedPayloads:
    """Validates envelope payloads with `models` into a struct array of `struct` (default
    `typed_struct(models)`); `version` fingerprints the models and their Arrow schema."""

    def __init__(self, models: Models, struct: pa.StructType | None = None) -> None:
        self.models = dict(models)
        self.struct = struct if struct is not None else typed_struct(self.models)
        self.spec = models_spec(self.models)
        text = f"{self.spec}\n{self.struct}".encode()
        self.version = hashlib.sha256(text).hexdigest()[:16]
        self.any_type = None in self.models
        self.flat = {k: _flat(m) for k, m in self.models.items()}
        self.adapters = {k: TypeAdapter(list[m]) for k, m in self.models.items()}  # type: ignore[valid-type]
        # msgspec mirrors of the simple models: payloads decoded into them are validated already
        self.mirrors = {k: mirror_struct(m) for k, m in self.models.items()}

    def payloads(
        self, data: Sequence[bytes], types: Sequence[str | None]
    ) -> tuple[list[Any], dict[str | None, list[int]], list[str | None]]:
        """The decoded payloads of the entries of modelled types (others None), their indexes
        by event type, and per entry a DecodeError text or None."""
        n = len(data)
        payloads: list[Any] = [None] * n
        errors: list[str | None] = [None] * n
        groups: dict[str | None, list[int]] = {}
        for i, (raw, etype) in enumerate(zip(data, types, strict=True)):
            key = None if self.any_type else etype
            if key not in self.models:
                continue
            try:
                payloads[i] = _payload(raw)
            except DecodeError as exc:
                errors[i] = f"DecodeError: {exc}"
                continue
            groups.setdefault(key, []).append(i)
        return payloads, groups, errors

    def validate(
        self, payloads: list[Any], groups: dict[str | None, list[int]], errors: list[str | None]
    ) -> pa.StructArray:
        """Validate the grouped `payloads` into a struct array (null where invalid, with the
        reason set in `errors`): one list validation per type; row by row only when it fails."""
        rows: list[dict[str, Any] | None] = [None] * len(payloads)
        for key, idx in groups.items():
            model = self.models[key]
            mirror = self.mirrors[key]
            if mirror is not None:  # decoded into the mirror: valid, its values are the model's
                done = [i for i in idx if type(payloads[i]) is mirror]
                for i in done:
                    rows[i] = msgspec.structs.asdict(payloads[i])
                if len(done) == len(idx):
                    continue
                idx = [i for i in idx if type(payloads[i]) is not mirror]
            try:
                valid: list[BaseModel] = self.adapters[key].validate_python(
                    [payloads[i] for i in idx]
                )
            except ValidationError:
                for i in idx:
                    try:
                        rows[i] = _row(model.model_validate(payloads[i]))
                    except ValidationError as exc:
                        errors[i] = f"ValidationError: {model.__name__}: {_short(exc)}"
                continue
            as_row = (lambda m: m.__dict__) if self.flat[key] else _row
            for i, m in zip(idx, valid, strict=True):
                rows[i] = as_row(m)
        return _struct_array(rows, self.struct, errors)

    def columns_of(
        self, payloads: list[Any], types: pa.Array
    ) -> tuple[pa.StructArray, list[str | None]]:
        """`columns` of entries whose envelopes are decoded already: their `payloads` and event
        `types` (a string array; the offloader decodes each envelope once, for all of its
        columns)."""
        n = len(payloads)
        if self.any_type:
            groups: dict[str | None, list[int]] = {None: list(range(n))}
        else:
            groups = {}
            for i, etype in enumerate(types.to_pylist()):
                if etype in self.models:
                    groups.setdefault(etype, []).append(i)
        errors: list[str | None] = [None] * n
        if len(groups) == 1 and n:  # one model, every payload decoded into its mirror: tuples
            ((key, idx),) = groups.items()
            mirror = self.mirrors[key]
            if (
                mirror is not None
                and len(idx) == n
                and mirror.__struct_fields__ == tuple(self.struct.names)
                and set(map(type, payloads)) == {mirror}
            ):
                rows = list(map(msgspec.structs.astuple, payloads))
                return _struct_array(rows, self.struct, errors), errors
        return self.validate(payloads, groups, errors), errors

    def columns(
        self, data: Sequence[bytes], types: Sequence[str | None]
    ) -> tuple[pa.StructArray, list[str | None]]:
        """The typed struct of entries with raw `data` and event `types`, and per entry why it
        has no typed values (None: valid, or a type without a model)."""
        payloads, groups, errors = self.payloads(data, types)
        return self.validate(payloads, groups, errors), errors


_ARROW_REFUSED = (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError)


def _struct_array(rows: list[Any], struct: pa.StructType, errors: list[str | None]) -> Any:
    """``pa.array(rows, struct)``; when Arrow refuses a value that validated (an int beyond
    int64 — pydantic's ``int`` is unbounded, MessagePack carries up to 2**64 - 1 — or a value
    past a type's range), the rows it refuses are null with the reason in `errors`, as an
    invalid payload is, instead of failing the whole page (and so the offloader, at that entry,
    for ever)."""
    try:
        return pa.array(rows, struct)
    except _ARROW_REFUSED:
        kept: list[Any] = []
        for i, row in enumerate(rows):
            if row is not None:
                try:
                    pa.array([row], struct)
                except _ARROW_REFUSED as exc:
                    errors[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row = None
            kept.append(row)
        return pa.array(kept, struct)


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
