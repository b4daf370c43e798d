"""A poison entry in the Spark source, without a SparkSession: the rows of the Redis tail are
built as a segment's (`entries_batch`), then converted to the read schema (`Converter`). An
entry nested deeper than the decoders go (`cases.poison_entry_cases.DEPTH`) raised
``RecursionError`` out of `entries_batch` (the envelope columns), failing the whole
micro-batch; now its row is kept with null envelope columns and, in ``PERMISSIVE`` mode, the
reason in ``_corrupt``, beside the other rows (the live paths: `cases.poison_entry_cases`)."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from cases.poison_entry_cases import POISON_ERROR, deep_payload_entry
from pydantic import BaseModel

from eventbus.errors import DecodeError
from eventbus.protocol.codec import Envelope, encode_entry
from eventbus.protocol.ids import EntryId
from eventbus.spark.decode import Converter
from eventbus.spark.reading import entries_batch
from eventbus.spark.schema import CORRUPT, arrow_schema, read_schema


class Tick(BaseModel):
    resource: str
    seq: int


def _rows() -> list[tuple[EntryId, dict[bytes, bytes]]]:
    good = [
        encode_entry(Envelope("a", "Tick", bytes(16), 1, {}, {"resource": "a", "seq": seq}))
        for seq in range(2)
    ]
    return [
        (EntryId(5, 0), good[0]),
        (EntryId(5, 1), deep_payload_entry("a")),
        (EntryId(5, 2), good[1]),
    ]


def test_the_row_is_kept_and_reported_corrupt_beside_the_others() -> None:
    batch = entries_batch("orders", 0, _rows())
    assert batch.column("event_id").to_pylist()[1] is None  # the envelope did not decode
    models = {"Tick": Tick}
    out = Converter(arrow_schema(read_schema(models)), models, "PERMISSIVE").convert(batch)
    assert out.column("seq").to_pylist() == [0, None, 1]
    corrupt = out.column(CORRUPT).to_pylist()
    # 3.11: the payload's RecursionError leaves it for the model to refuse; 3.12+: the envelope's
    assert corrupt[0] is None and corrupt[2] is None
    assert ("Tick" if POISON_ERROR == "RecursionError" else POISON_ERROR) in corrupt[1]


def test_failfast_raises_a_decode_error_naming_the_entry() -> None:
    models = {"Tick": Tick}
    converter = Converter(arrow_schema(read_schema(models)), models, "FAILFAST")
    with pytest.raises(DecodeError, match="entry 5-1 of shard 0"):
        converter.convert(entries_batch("orders", 0, _rows()))
