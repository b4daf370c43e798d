"""Payloads read from Arrow columns for the writer: a model of plain typed fields
(`plain_fields`: ``int``, ``float``, ``str``, ``bool``, optional or not, nothing pydantic would
change) gets its rows' payloads column by column (`typed_payloads`), as
``model_dump(mode="json")`` of each validated row would give, without a pydantic model per row."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from itertools import repeat
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, RootModel

_ARROW_KINDS: dict[type, Callable[[pa.DataType], bool]] = {
    int: pa.types.is_integer,
    float: pa.types.is_floating,
    str: lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
    bool: pa.types.is_boolean,
}


def plain_fields(model: type[BaseModel]) -> dict[str, tuple[type, bool, Any]] | None:
    """The model's fields as ``name -> (int|float|str|bool, nullable, default)`` (default
    `...` when required), in declaration order, when validating and dumping it (json mode) is
    the identity on values of those types: no validators, serializers, computed fields,
    aliases, constraints, default factories or model settings. None otherwise."""
    decorators = model.__pydantic_decorators__
    if (
        model.model_config
        or any(getattr(decorators, f.name) for f in dataclasses.fields(decorators))
        or model.__pydantic_post_init__ is not None
        or issubclass(model, RootModel)
    ):
        return None
    out: dict[str, tuple[type, bool, Any]] = {}
    for name, info in model.model_fields.items():
        if (
            info.alias
            or info.validation_alias
            or info.serialization_alias
            or info.metadata
            or info.exclude
            or info.default_factory is not None
        ):
            return None
        kind, nullable = info.annotation, False
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            if len(args) != 1 or len(typing.get_args(kind)) != 2:
                return None
            kind, nullable = args[0], True
        if kind not in _ARROW_KINDS:
            return None
        default = ... if info.is_required() else info.default
        if default is not ... and not (default is None or type(default) is kind):
            return None
        out[name] = (kind, nullable, default)
    return out


def typed_payloads(
    batch: pa.RecordBatch, fields: dict[str, tuple[type, bool, Any]]
) -> list[dict[str, Any]] | None:
    """The payloads of `batch`'s rows as the model of `fields` (`plain_fields`) would dump
    them (``model_dump(mode="json")``: its fields in order, defaults for absent columns), read
    column by column, no model per row. None when a column would not validate as is (missing
    required field, another Arrow type, a null in a required field, a NaN or infinity): the
    caller validates that batch through pydantic, which says why or converts."""
    names = batch.schema.names
    columns: list[Any] = []
    for name, (kind, nullable, default) in fields.items():
        if name not in names:
            if default is ...:
                return None
            columns.append(repeat(default))
            continue
        col = batch.column(name)
        if not _ARROW_KINDS[kind](col.type) or (col.null_count and not nullable):
            return None
        if kind is float and len(col) > col.null_count and not pc.all(pc.is_finite(col)).as_py():
            return None
        columns.append(col.to_pylist())
    if all(isinstance(c, repeat) for c in columns):  # no column of the model: zip never ends
        return None
    keys = list(fields)
    return [dict(zip(keys, values, strict=False)) for values in zip(*columns, strict=False)]
