"""The Python source's typed columns taken from a typed segment's own columns when they are the
read's (no payload decoding: a stream's micro-batches and the Python path read at Arrow speed),
giving the rows decoding ``data`` gives; decoded otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pydantic import BaseModel

from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.spark.decode import Converter
from eventbus.spark.objects import Objects
from eventbus.spark.reading import segment_batches
from eventbus.spark.schema import arrow_schema, read_schema
from eventbus.tier.layout import parse_segment_key, segment_key
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import open_store
from eventbus.tier.typed import TypedPayloads, load_models

MS = 1_700_000_000_000


class Pop(BaseModel):
    country: str
    count: int


class PopV2(BaseModel):
    country: str
    count: int
    source: str | None = None


def _segment(root: Path, setting: str) -> Objects:
    payloads = [
        ("pop.count", {"country": "NL", "count": 3}),
        ("note", {"text": "x"}),
        ("pop.count", {"country": "BE", "count": "many"}),  # does not validate
    ]
    entries = []
    for i, (etype, payload) in enumerate(payloads):
        env = Envelope(f"r{i}", etype, new_event_id(), MS + i, {}, payload)
        entries.append((EntryId(MS + i, 0), encode_entry(env)))
    models = load_models(setting)
    assert models is not None
    first, last = entries[0][0], entries[-1][0]
    data, _ = encode_segment("pop", 0, first, last, entries, typed=TypedPayloads(models))
    key = segment_key("pop", 0, first, last)
    (root / key).parent.mkdir(parents=True)
    (root / key).write_bytes(data)
    return Objects(open_store(str(root)))


def _rows(objects: Objects, model: Any, use_columns: bool) -> tuple[list[dict[str, Any]], bool]:
    models = load_models(model)
    conv = Converter(arrow_schema(read_schema(models)), models)
    (ref,) = objects.segments("pop", 0)
    ref = parse_segment_key(ref.key, ref.size)
    assert ref is not None
    (batch,) = segment_batches(objects, ref, conv.read_typing if use_columns else None)
    columns = "typed_error" in batch.schema.names
    return pa.Table.from_batches([conv.convert(batch)]).to_pylist(), columns


@pytest.mark.parametrize(
    ("setting", "model", "columns"),
    [
        (f'{{"pop.count": "{__name__}:Pop"}}', f'{{"pop.count": "{__name__}:Pop"}}', True),
        (f"{__name__}:Pop", f'{{"pop.count": "{__name__}:Pop"}}', True),  # masked: notes
        (f'{{"pop.count": "{__name__}:Pop"}}', f"{__name__}:Pop", False),  # notes decoded
        (f"{__name__}:Pop", f"{__name__}:PopV2", False),  # source: its default, decoded
    ],
)
def test_typed_columns_give_the_rows_decoding_gives(
    tmp_path: Path, setting: str, model: str, columns: bool
) -> None:
    objects = _segment(tmp_path, setting)
    fast, used = _rows(objects, model, use_columns=True)
    slow, decoded = _rows(objects, model, use_columns=False)
    assert (used, decoded) == (columns, False)
    assert fast == slow
    assert fast[0]["count"] == 3 and fast[1]["country"] is None
    assert fast[2]["_corrupt"] is not None and fast[2]["_corrupt"].startswith("ValidationError")
