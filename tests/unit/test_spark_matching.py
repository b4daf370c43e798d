"""Typed segments matched to a read's models by what they hold: the event types their typed
columns were written for and the columns' types, not the text of the offloader's setting."""

from __future__ import annotations

import io
import itertools
from typing import Any

import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark")

from pydantic import BaseModel

from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.spark.matching import (
    CORRUPT_MASK,
    ReadTyping,
    SegmentTyping,
    TypedColumnConflict,
    match,
    segment_typing,
)
from eventbus.spark.options import models_option
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.typed import TypedPayloads, load_models

MS = 1_700_000_000_000


class Pop(BaseModel):
    country: str
    count: int


class PopV2(BaseModel):  # a field added later
    __event_type__ = "pop.count"
    country: str
    count: int
    source: str | None = None


class PopCountText(BaseModel):  # a column's type changed
    country: str
    count: str


class Note(BaseModel):
    text: str


def entry(i: int, etype: str, payload: dict[str, Any]) -> tuple[EntryId, dict[bytes, bytes]]:
    env = Envelope(f"r{i}", etype, new_event_id(), MS + i, {}, payload)
    return EntryId(MS + i, 0), encode_entry(env)


def segment(
    setting: str, types: list[str], key: str = "pop/0/x.parquet", rebuild_data: bool = False
) -> SegmentTyping:
    """A segment the offloader writes with `setting` (``typed_models``'s value for the topic),
    of entries of `types`, as its footer reads."""
    entries = [
        entry(i, t, {"country": "NL", "count": i} if t == "pop.count" else {"text": "x"})
        for i, t in enumerate(types)
    ]
    models = load_models(setting)
    assert models is not None
    data, _ = encode_segment(
        *("pop", 0, entries[0][0], entries[-1][0], entries),
        typed=TypedPayloads(models),
        rebuild_data=rebuild_data,
    )
    return segment_typing(key, pq.read_metadata(io.BytesIO(data)))


def untyped(types: list[str]) -> SegmentTyping:
    entries = [entry(i, t, {"country": "NL", "count": i}) for i, t in enumerate(types)]
    data, _ = encode_segment("pop", 0, entries[0][0], entries[-1][0], entries)
    return segment_typing("pop/0/u.parquet", pq.read_metadata(io.BytesIO(data)))


def reading(form: Any) -> ReadTyping:
    """A read's models given in one of the forms docs/spark.md shows (`models_option`)."""
    models = load_models(models_option(form))
    assert models is not None
    return ReadTyping.of(models)


OFFLOAD_FORMS = [  # docs/tier.md: "pkg.mod:Model" or {"<event type>": "pkg.mod:Model"}
    f"{__name__}:Pop",
    f'{{"pop.count": "{__name__}:Pop"}}',
]
READ_FORMS = [  # docs/spark.md: a class, "pkg.mod:Model", a mapping of paths or of classes
    Pop,
    f"{__name__}:Pop",
    {"pop.count": f"{__name__}:Pop"},
    {"pop.count": Pop},
]


@pytest.mark.parametrize(
    ("setting", "form"),
    list(itertools.product(OFFLOAD_FORMS, READ_FORMS)),
    ids=[f"{o[:1]}-{i}" for o, i in itertools.product("sm", range(len(READ_FORMS)))],
)
def test_every_offload_form_matches_every_read_form(setting: str, form: Any) -> None:
    seg = segment(setting, ["pop.count"] * 3)
    found = match(reading(form), [seg])
    assert (found.native, found.python, found.why) == ([0], [], None)
    assert found.masked == frozenset()  # one event type in the segment: nothing to null


def test_a_segment_written_for_every_entry_read_for_one_type_masks_the_other_types() -> None:
    """A read of ``{"pop.count": Pop}`` over a segment written with ``Pop`` for every entry
    (notes validated as Pop too): the typed columns and ``_corrupt`` are nulled on the rows of
    other types, as the Python source gives them."""
    seg = segment(f"{__name__}:Pop", ["pop.count", "note", "pop.count"])
    found = match(reading({"pop.count": Pop}), [seg])
    assert (found.native, found.python) == ([0], [])
    assert found.masked == {"country", "count", CORRUPT_MASK}


def test_a_read_of_every_entry_needs_every_entry_typed() -> None:
    """One model for every entry over a segment typed for ``pop.count`` only: natively when all
    its rows are ``pop.count`` (the Parquet statistics of ``event_type``), else its other rows
    need ``data`` decoded by the Python source."""
    setting = f'{{"pop.count": "{__name__}:Pop"}}'
    mixed = segment(setting, ["note", "pop.count"], key="pop/0/mixed.parquet")
    only = segment(setting, ["pop.count", "pop.count"], key="pop/0/only.parquet")
    found = match(reading(Pop), [only, mixed])
    assert (found.native, found.python) == ([0], [1])
    assert found.why is not None and "1 of 2 segments have typed columns for other event" in (
        found.why
    )


def test_a_segment_without_entries_of_the_read_type_needs_no_typed_columns_for_it() -> None:
    seg = segment(f'{{"note": "{__name__}:Note"}}', ["note", "note"])
    assert match(reading({"pop.count": Pop}), [seg]).native == [0]
    assert match(reading({"note": Note}), [seg]).native == [0]


def test_schema_versions_read_together_and_a_changed_type_names_column_and_segments() -> None:
    old = segment(f"{__name__}:Pop", ["pop.count"], key="pop/0/old.parquet")
    new = segment(f"{__name__}:PopV2", ["pop.count"], key="pop/0/new.parquet")
    for form in (Pop, PopV2, {"pop.count": PopV2}):
        found = match(reading(form), [old, new])
        assert (found.native, found.python, found.why) == ([0, 1], [], None)
    text = segment(f"{__name__}:PopCountText", ["pop.count"], key="pop/1/text.parquet")
    with pytest.raises(TypedColumnConflict) as caught:
        match(reading(PopV2), [old, new, text])
    said = str(caught.value)
    assert "column 'count' is string in 1 segment(s) (pop/1/text.parquet)" in said
    assert "bigint in the read's models" in said


def test_untyped_segments_are_named_and_left_to_the_python_source() -> None:
    found = match(reading(Pop), [untyped(["pop.count"]), segment(f"{__name__}:Pop", ["x"])])
    assert (found.native, found.python) == ([1], [0])
    assert found.why == "1 of 2 segments have no typed columns"


def test_segments_that_leave_out_rebuilt_data_are_left_to_the_python_source() -> None:
    """Spark's Parquet reader cannot rebuild ``data`` (segment version 3): the Python source
    reads those segments, through the tier's reader, which rebuilds it."""
    setting = f"{__name__}:Pop"
    kept = segment(setting, ["pop.count"], key="pop/0/kept.parquet")
    left_out = segment(setting, ["pop.count"], key="pop/0/v3.parquet", rebuild_data=True)
    assert (kept.rebuilt, left_out.rebuilt) == (False, True)
    found = match(reading(Pop), [kept, left_out])
    assert (found.native, found.python) == ([0], [1])
    assert found.why == (
        "1 of 2 segments leave out the data their typed columns rebuild (segment version 3)"
    )


def test_a_segment_written_for_every_entry_with_another_model_is_not_taken_for_a_type() -> None:
    """A segment's ``*`` does not say which event type its model is for: a read's type is
    covered by it when the segment names the same model, or holds entries of that type only."""
    mixed = segment(f"{__name__}:PopV2", ["pop.count", "note"], key="pop/0/mixed.parquet")
    only = segment(f"{__name__}:PopV2", ["pop.count"], key="pop/0/only.parquet")
    found = match(reading({"pop.count": Pop}), [mixed, only])
    assert (found.native, found.python) == ([1], [0])
    assert match(reading({"pop.count": PopV2}), [mixed, only]).native == [0, 1]
