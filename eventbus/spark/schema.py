"""Spark schemas of a topic read: the fixed columns, and typed columns from pydantic models.

Fixed columns (every read), in this order:

============== ===================== ==========================================================
column         Spark type            meaning
============== ===================== ==========================================================
topic          string                topic name
shard          int                   shard index
entry_id       string                Redis entry ID ``<ms>-<seq>``
entry_ms       bigint                its millisecond part: Redis clock at XADD (Unix ms)
entry_seq      bigint                its sequence part
resource_id    string                the entry's ``rid`` field
event_type     string                the entry's ``type`` field
event_id       string                envelope event ID (UUID text)
published_at   timestamp             envelope time (publisher clock), microsecond precision
headers        map<string,string>    envelope headers
payload        binary                the entry's raw ``data`` field (the envelope as published)
============== ===================== ==========================================================

With a model, one column per model field follows (`model_fields`), then always ``_corrupt``
(string): null, or why the row's payload did not decode (or why its segment is corrupt).
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pydantic import BaseModel
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from eventbus.errors import ConfigError
from eventbus.tier.gaps import Gap

CORRUPT = "_corrupt"

BASE = StructType(
    [
        StructField("topic", StringType()),
        StructField("shard", IntegerType()),
        StructField("entry_id", StringType()),
        StructField("entry_ms", LongType()),
        StructField("entry_seq", LongType()),
        StructField("resource_id", StringType()),
        StructField("event_type", StringType()),
        StructField("event_id", StringType()),
        StructField("published_at", TimestampType()),
        StructField("headers", MapType(StringType(), StringType())),
        StructField("payload", BinaryType()),
    ]
)
BASE_NAMES = tuple(BASE.fieldNames())


_SCALARS: dict[type, DataType] = {
    bool: BooleanType(),  # before int: bool is an int
    int: LongType(),
    float: DoubleType(),
    str: StringType(),
    bytes: BinaryType(),
    dt.datetime: TimestampType(),
    dt.date: DateType(),
}
_AS_TEXT = (uuid.UUID, decimal.Decimal)


def spark_type(annotation: Any) -> DataType:
    """The Spark type of a pydantic field annotation.

    ``X | None`` is X (nullable); ``int`` bigint; ``float`` double; ``datetime`` timestamp;
    ``list[X]``/``tuple``/``set`` array; ``dict[str, X]`` map; a model a struct; an enum the type
    of its values; ``Literal`` the type of its values; UUID, Decimal and anything else string
    (UUID/Decimal as text, other values as JSON text).
    """
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return spark_type(args[0]) if len(args) == 1 else StringType()
    if origin is typing.Annotated:
        return spark_type(args[0])
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        return spark_type(kinds.pop()) if len(kinds) == 1 else StringType()
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return ArrayType(spark_type(inner[0]) if len(set(inner)) == 1 else StringType())
    if origin in (dict, Mapping):
        return MapType(StringType(), spark_type(args[1]) if len(args) == 2 else StringType())
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return model_struct(annotation)
        if issubclass(annotation, enum.Enum):
            kinds = {type(m.value) for m in annotation}
            return _SCALARS.get(kinds.pop(), StringType()) if len(kinds) == 1 else StringType()
        for py, spark in _SCALARS.items():
            if issubclass(annotation, py):
                return spark
    return StringType()


def model_struct(model: type[BaseModel]) -> StructType:
    """A struct with one field per field of `model` (by field name, in declaration order)."""
    return StructType(
        [StructField(name, spark_type(f.annotation)) for name, f in model.model_fields.items()]
    )


GAPS = StructType(
    [  # shard is an int, as in the entries' columns; the rest typed as the record's fields
        StructField(name, IntegerType() if name == "shard" else spark_type(kind))
        for name, kind in typing.get_type_hints(Gap).items()
    ]
    + [StructField("key", StringType())]  # the record's object key (`Gap.key`)
)
"""The side table of gap records (``option("table", "gaps")``): the fields of
`eventbus.tier.gaps.Gap`, then ``key``."""


def typed_fields(models: Mapping[str | None, type[BaseModel]]) -> list[StructField]:
    """The union of the models' fields, in first-seen order. Raises `ConfigError` when two
    models give one field name two types, or a field name is a fixed column's."""
    out: dict[str, StructField] = {}
    for model in models.values():
        for field in model_struct(model).fields:
            if field.name in BASE_NAMES or field.name == CORRUPT:
                raise ConfigError(
                    f"model {model.__name__} has a field {field.name!r}, the name of a fixed "
                    "column of the eventbus source; rename the field (or alias it)"
                )
            seen = out.get(field.name)
            if seen is not None and seen.dataType != field.dataType:
                raise ConfigError(
                    f"field {field.name!r} is {seen.dataType.simpleString()} in one model and "
                    f"{field.dataType.simpleString()} in {model.__name__}"
                )
            out.setdefault(field.name, field)
    return list(out.values())


def read_schema(models: Mapping[str | None, type[BaseModel]] | None) -> StructType:
    """The schema of a read: fixed columns, the models' fields, ``_corrupt``."""
    fields = list(BASE.fields) + (typed_fields(models) if models else [])
    return StructType([*fields, StructField(CORRUPT, StringType())])


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects from `read()` batches for `schema` (exactly)."""
    return to_arrow_schema(schema, timezone="UTC")
