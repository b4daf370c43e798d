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

import functools
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

# `eventbus.tier.typed` (pydantic, msgspec, the entry codec) is imported by the functions that
# map models: a read without a model, and the stream's planner, start without it

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


def spark_type(annotation: Any) -> DataType:
    """The Spark type of a pydantic field annotation: Spark's type of its Arrow type
    (`eventbus.tier.typed.arrow_type`, the typed segment columns' mapping), so the source's
    typed columns and the segments' are the same."""
    from eventbus.tier.typed import arrow_type

    return from_arrow_type(arrow_type(annotation))


@functools.cache
def gaps_schema() -> StructType:
    """The side table of gap records (``option("table", "gaps")``): the fields of
    `eventbus.tier.gaps.Gap`, then ``key``. Built on first use: the tier's gap records import
    pydantic models and the tier's metrics, which a process that reads no gap table (the
    stream's planner, a Python worker) need not pay for."""
    from eventbus.tier.gaps import Gap

    return StructType(
        [  # shard is an int, as in the entries' columns; the rest typed as the record's fields
            StructField(name, IntegerType() if name == "shard" else spark_type(kind))
            for name, kind in typing.get_type_hints(Gap).items()
        ]
        + [StructField("key", StringType())]  # the record's object key (`Gap.key`)
    )


def typed_fields(models: Mapping[str | None, type[BaseModel]]) -> list[StructField]:
    """The union of the models' fields, in first-seen order (`eventbus.tier.typed.typed_struct`,
    whose `ConfigError` it raises for a field of two types or with a fixed column's name)."""
    from eventbus.tier.typed import typed_struct

    return list(from_arrow_type(typed_struct(models)).fields)  # type: ignore[attr-defined]


def read_schema(models: Mapping[str | None, type[BaseModel]] | None) -> StructType:
    """The schema of a read: fixed columns, the models' fields, ``_corrupt``."""
    fields = list(BASE.fields) + (typed_fields(models) if models else [])
    return StructType([*fields, StructField(CORRUPT, StringType())])


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects from `read()` batches for `schema` (exactly)."""
    return to_arrow_schema(schema, timezone="UTC")
