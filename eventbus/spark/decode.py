"""Read-schema batches for Spark: fixed columns by vectorised casts, typed payload columns.

`Converter` takes Arrow record batches of the segment schema (`eventbus.tier.segment.SCHEMA`),
whether the rows came from a segment or from ``XRANGE`` (`eventbus.spark.reading`), and returns
batches of the read schema (`eventbus.spark.schema`); only payload decoding (with a model)
touches rows one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from eventbus.errors import DecodeError
from eventbus.spark.matching import EVERY, ReadTyping
from eventbus.spark.schema import BASE_NAMES, CORRUPT, arrow_schema
from eventbus.tier.typed import ERROR_COLUMN, TypedPayloads

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

    from eventbus.spark.options import SourceOptions

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
        typed_type = pa.struct([target.field(n) for n in self.typed_names])
        self.typed = TypedPayloads(self.models, typed_type)
        self.read_typing = ReadTyping.of(self.models) if self.models else None

    @classmethod
    def of(cls, opts: SourceOptions, schema: StructType) -> Converter:
        """The converter of a read of `opts` into Spark's `schema`."""
        return cls(arrow_schema(schema), opts.models(), opts.mode, opts.validate)

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
        corrupt_array = None
        if self.models and self._has_typed(batch):
            typed, corrupt_array = self._from_columns(batch)
        elif self.models:
            typed, corrupt = self._typed(batch)
        arrays = []
        for field in self.target:
            if field.name in base:
                arrays.append(base[field.name].cast(field.type))
            elif field.name == CORRUPT and corrupt_array is not None:
                arrays.append(corrupt_array)
            elif field.name == CORRUPT:
                arrays.append(pa.array(corrupt if corrupt else [None] * n, pa.string()))
            else:
                arrays.append(typed[field.name].cast(field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.target)

    def _has_typed(self, batch: pa.RecordBatch) -> bool:
        """Whether `batch` carries the segment's typed columns of this read
        (`eventbus.spark.reading.typed_columns`)."""
        names = batch.schema.names
        return ERROR_COLUMN in names and all(n in names for n in self.typed_names)

    def _from_columns(self, batch: pa.RecordBatch) -> tuple[dict[str, Any], Any]:
        """The typed columns and ``_corrupt`` from a segment's typed columns, each null on rows
        of event types the read does not model for it (as decoding gives them). Raises
        `DecodeError` for an invalid row under ``FAILFAST``."""
        typing = self.read_typing
        assert typing is not None
        etype = batch.column("event_type")

        def masked(column: Any, types: frozenset[str]) -> Any:
            if EVERY in types:
                return column
            keep = pc.fill_null(pc.is_in(etype, pa.array(sorted(types), pa.string())), False)
            return pc.if_else(keep, column, pa.nulls(len(column), column.type))

        cols = {n: masked(batch.column(n), typing.fields[n]) for n in self.typed_names}
        corrupt = masked(batch.column(ERROR_COLUMN), typing.keys).cast(pa.string())
        if self.failfast and corrupt.null_count < len(corrupt):
            i = pc.index(pc.is_valid(corrupt), True).as_py()
            entry = batch.column("entry_id")[i].as_py()
            raise DecodeError(f"entry {entry} of shard {batch.column('shard')[i]}: {corrupt[i]}")
        return cols, corrupt

    def _typed(self, batch: pa.RecordBatch) -> tuple[dict[str, Any], list[str | None] | None]:
        data = batch.column("data").to_pylist()
        etypes = (
            [None] * len(data) if self.typed.any_type else batch.column("event_type").to_pylist()
        )
        payloads, groups, corrupt = self.typed.payloads(data, etypes)
        struct = None
        if not self.validate:  # payload maps straight to Arrow, if they all convert
            try:
                struct = pa.array(payloads, self.typed.struct)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                struct = None
        if struct is None:
            struct = self.typed.validate(payloads, groups, corrupt)
        if self.failfast and any(c is not None for c in corrupt):
            i = next(i for i, c in enumerate(corrupt) if c is not None)
            entry = batch.column("entry_id")[i].as_py()
            raise DecodeError(f"entry {entry} of shard {batch.column('shard')[i]}: {corrupt[i]}")
        cols = dict(zip(self.typed_names, struct.flatten(), strict=True))
        return cols, corrupt if any(c is not None for c in corrupt) else None
