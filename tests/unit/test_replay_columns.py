"""Typed replay builds events from a segment's typed columns only where that gives exactly what
`Model.model_validate(payload)` gives (flights and a nested model, a property over lax and odd
payloads, both segment formats); segments written for another model, or models whose
validation a plain build would skip, are validated from their payloads."""

from __future__ import annotations

import io
import math
import random
from typing import Any

import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import eventbus.tier.replay as replay_module
import eventbus.tier.replay_columns as replay_columns_module
from eventbus.errors import DecodeError
from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.tier.archived import ReplayFilter
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.layout import SegmentRef, parse_segment_key, segment_key
from eventbus.tier.replay import iter_events
from eventbus.tier.replay_columns import ColumnReplay, TypedBatch, constructible
from eventbus.tier.replay_events import ReplayedEvent
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import open_store
from eventbus.tier.typed import TypedPayloads
from examples.flights.flightdata import Flight

MS = 1_700_000_000_000
FLIGHT = "flights.Flight"


class Item(BaseModel):
    sku: str
    qty: int


class Order(BaseModel):
    order: int
    total: float
    items: list[Item]
    note: str | None


def _segment(
    payloads: list[Any], etype: str, typed: TypedPayloads, rebuild_data: bool
) -> tuple[Any, str]:
    """A store holding one typed segment of `payloads` (event type `etype`)."""
    ids = [EntryId(MS + i, i % 2) for i in range(len(payloads))]
    rows = [
        (i, encode_entry(Envelope(f"r{k}", etype, new_event_id(), MS + k, {}, p)))
        for k, (i, p) in enumerate(zip(ids, payloads, strict=True))
    ]
    data, _ = encode_segment("t", 0, ids[0], ids[-1], rows, typed=typed, rebuild_data=rebuild_data)
    store = open_store("memory://")
    key = segment_key("t", 0, ids[0], ids[-1])
    obstore.put(store, key, data)
    return store, key


def _same(got: BaseModel, want: BaseModel) -> bool:
    """Equal as validation makes them: type, field values (NaN equal to NaN) and their order,
    the fields set, no extra."""

    def norm(d: dict[str, Any]) -> list[Any]:
        return [(k, "nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()]

    return (
        type(got) is type(want)
        and norm(got.__dict__) == norm(want.__dict__)
        and got.model_fields_set == want.model_fields_set
        and got.__pydantic_extra__ == want.__pydantic_extra__
        and got.__pydantic_private__ == want.__pydantic_private__
    )


def _replays_as_validation(
    payloads: list[Any], model: type[BaseModel], etype: str, rebuild_data: bool
) -> int:
    """Replay `payloads` archived with typed columns for `model`; assert every event is
    `model.model_validate` of its payload (and its envelope the entry's decoded one), up to
    the first payload that does not validate, whose entry must raise. Returns how many rows
    the typed columns built."""
    store, key = _segment(payloads, etype, TypedPayloads({etype: model}), rebuild_data)
    want: list[BaseModel] = []
    for p in payloads:
        try:
            want.append(model.model_validate(p))
        except ValidationError:
            break
    got: list[ReplayedEvent] = []
    try:
        for ev in iter_events(store, "t", [model] if etype != FLIGHT else {FLIGHT: model}):
            got.append(ev)
    except DecodeError:  # the first payload that does not validate
        assert len(want) < len(payloads)
    assert len(got) == len(want)
    for ev, w in zip(got, want, strict=True):
        assert _same(ev.event, w), (ev.event, w)
        assert repr(ev.envelope) == repr(ev.entry.envelope())  # (NaN: == is False)
    batches = ColumnReplay({etype: model}).open_batches(
        bytes(obstore.get(store, key).bytes()), _ref(key), ReplayFilter(), 1000
    )[1]
    return _built_rows(batches)


def _ref(key: str) -> SegmentRef:
    ref = parse_segment_key(key)
    assert ref is not None
    return ref


def _built_rows(batches: Any) -> int:
    """The rows of `batches` the typed columns build (`TypedBatch.kinds` names a type)."""
    return sum(sum(k is not None for k in b.kinds) for b in batches if isinstance(b, TypedBatch))


_int = st.integers(-(2**63), 2**63 - 1)
_text = st.text(max_size=8)
_lax_int = _int | _int.map(str) | st.booleans() | st.integers(-5, 5).map(float) | _text


def _flight(draw: Any) -> dict[str, Any]:
    """A flights payload: each field a value of its type, or None where it may be, or a lax
    value validation converts (an int as text, a bool, a float) or refuses; sometimes in
    another key order, with a key too many, or one left out."""
    out: dict[str, Any] = {}
    for name, field in Flight.model_fields.items():
        ann = str(field.annotation)
        value = draw(_lax_int if "int" in ann else _text | st.integers(0, 9))
        out[name] = None if "None" in ann and draw(st.booleans()) else value
    if draw(st.booleans()):
        choice = draw(st.sampled_from(["reversed", "extra", "missing"]))
        if choice == "reversed":
            out = dict(reversed(list(out.items())))
        elif choice == "extra":
            out["extra"] = 1
        else:
            out.pop(draw(st.sampled_from(sorted(out))))
    return out


_flights = st.composite(lambda draw: _flight(draw))()


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(payloads=st.lists(_flights, min_size=1, max_size=12), rebuild_data=st.booleans())
def test_flights_replayed_from_typed_columns_equal_validation(
    payloads: list[dict[str, Any]], rebuild_data: bool
) -> None:
    _replays_as_validation(payloads, Flight, FLIGHT, rebuild_data)


_items = st.lists(st.fixed_dictionaries({"sku": _text, "qty": _lax_int}), max_size=3)
_orders = st.fixed_dictionaries(
    {
        "order": _lax_int,
        "total": st.floats(allow_nan=True) | _int,
        "items": _items,
        "note": st.none() | _text,
    }
)


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(payloads=st.lists(_orders, min_size=1, max_size=12), rebuild_data=st.booleans())
@example(payloads=[{"order": 0, "total": math.nan, "items": [], "note": None}], rebuild_data=False)
def test_nested_models_replay_as_validation(payloads: list[Any], rebuild_data: bool) -> None:
    assert _replays_as_validation(payloads, Order, "Order", rebuild_data) == 0  # not built


@pytest.mark.parametrize("rebuild_data", [False, True])
def test_exact_flight_payloads_are_built_from_columns_odd_ones_validated(
    rebuild_data: bool,
) -> None:
    base = {n: "x" if "str" in str(f.annotation) else 1 for n, f in Flight.model_fields.items()}
    odd = [{**base, "year": "2013"}, {**base, "extra": 1}, dict(reversed(list(base.items())))]
    payloads = [base, *odd, {**base, "dep_time": None}]
    assert _replays_as_validation(payloads, Flight, FLIGHT, rebuild_data) == 2


class WithValidator(BaseModel):
    seq: int

    @field_validator("seq")
    @classmethod
    def _double(cls, v: int) -> int:
        return 2 * v


class WithDefault(BaseModel):
    seq: int = 0


class Extra(BaseModel):
    model_config = ConfigDict(extra="allow")
    seq: int


class Constrained(BaseModel):
    seq: int = Field(gt=0)


class Plain(BaseModel):
    seq: int
    name: str | None


def test_only_models_a_plain_build_validates_exactly_are_constructible() -> None:
    assert constructible(Plain) is not None
    assert constructible(Flight) is not None
    for model in (WithValidator, WithDefault, Extra, Constrained, Order):
        assert constructible(model) is None, model


def test_a_segment_written_for_another_model_is_validated_from_payloads() -> None:
    payloads = [{"seq": 3, "name": "a"}]
    store, key = _segment(payloads, "Plain", TypedPayloads({"Plain": Plain}), False)
    ref = _ref(key)
    data = bytes(obstore.get(store, key).bytes())

    class Plain2(BaseModel):  # same fields, another name: not the segment's model
        seq: int
        name: str | None

    for models, built in (({"Plain": Plain}, 1), ({"Plain": Plain2}, 0), ({"Other": Plain}, 0)):
        batches = ColumnReplay(models).open_batches(data, ref, ReplayFilter(), 10)[1]
        assert _built_rows(batches) == built
    events = list(iter_events(store, "t", {"Plain": Plain2}))
    assert [e.event for e in events] == [Plain2(seq=3, name="a")]


def test_a_typed_segment_whose_event_id_is_no_uuid_is_corrupt() -> None:
    store, key = _segment(
        [{"seq": 1, "name": None}], "Plain", TypedPayloads({"Plain": Plain}), False
    )
    table = pq.read_table(io.BytesIO(bytes(obstore.get(store, key).bytes())))
    table = table.set_column(8, "event_id", pa.array(["not-a-uuid"], pa.string()))
    sink = io.BytesIO()
    pq.write_table(table, sink, write_page_checksum=True)
    obstore.put(store, key, sink.getvalue())
    with pytest.raises(CorruptSegment, match="event_id"):
        list(iter_events(store, "t", [Plain]))


# -- differential: the column path against validation of every payload, type-exactly ----------
class _A(BaseModel):
    a: int
    s: str | None


class _B(BaseModel):  # a default: never built from columns
    a: int
    s: str | None = None


class _C(BaseModel):
    a: int
    f: float


class _AFewer(BaseModel):  # _A as a later release of the same module:QualName has it
    s: str | None


class _AMore(BaseModel):
    a: int
    s: str | None
    f: float | None


for _changed in (_AFewer, _AMore):  # the same module:QualName in a segment's typed_models
    _changed.__qualname__ = _A.__qualname__


def _mixed_rows(n: int, seed: int, bad_at: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    rnd = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        kind = rnd.choice("ABCX")
        if kind == "A":
            p: dict[str, Any] = rnd.choice(
                [
                    {"a": i, "s": "x"},
                    {"a": i, "s": None},
                    {"a": str(i), "s": "lax"},
                    {"s": "y", "a": i},
                ]
            )
        elif kind == "B":
            p = {"a": i}
        elif kind == "C":
            p = rnd.choice([{"a": i, "f": 0.5}, {"a": i, "f": 1}, {"a": i, "f": math.inf}])
        else:
            p = {"zz": 1}
        out.append(("A", {"a": "bad", "s": None}) if i == bad_at else (kind, p))
    return out


def _segments(specs: list[tuple[int, int, list[tuple[str, Any]], Any, bool]]) -> Any:
    """A store of topic "t": (shard, first ms, rows (type, payload), models or None, rebuild)."""
    store = open_store("memory://")
    for shard, first, rows, models, rebuild_data in specs:
        ids = [EntryId(first + i, 0) for i in range(len(rows))]
        entries = [
            (
                i,
                encode_entry(
                    Envelope(
                        f"r{k % 3}",
                        et,
                        new_event_id(),
                        first + k,
                        {"k": "v"} if k % 4 == 0 else {},
                        p,
                    )
                ),
            )
            for k, (i, (et, p)) in enumerate(zip(ids, rows, strict=True))
        ]
        typed = {"typed": TypedPayloads(models), "rebuild_data": rebuild_data} if models else {}
        data, _ = encode_segment("t", shard, ids[0], ids[-1], entries, **typed)
        obstore.put(store, segment_key("t", shard, ids[0], ids[-1]), data)
    return store


def _exact(v: Any) -> Any:
    if isinstance(v, float):
        return ("float", "nan" if math.isnan(v) else v, math.copysign(1, v))
    return (type(v).__name__, v)


def _replayed(store: Any, models: dict[str, type[BaseModel]]) -> tuple[list[Any], str | None]:
    out, error = [], None
    try:
        for r in iter_events(store, "t", models):
            ev = r.event
            out.append(
                (
                    type(ev),
                    [(k, _exact(v)) for k, v in ev.__dict__.items()],
                    ev.model_fields_set,
                    ev.__pydantic_extra__,
                    repr(r.envelope),
                    r.entry,
                )
            )
    except DecodeError as exc:
        error = str(exc)
    return out, error


class _NoColumns(ColumnReplay):
    def __init__(self, models: Any) -> None:
        super().__init__(models)
        self.fields = {}


@pytest.mark.parametrize("rebuild_data", [False, True])
@pytest.mark.parametrize(
    "case", ["shards-overlap-types", "invalid-mid-batch", "model-fewer-fields", "model-more-fields"]
)
def test_the_column_path_replays_what_validating_every_payload_replays(
    monkeypatch: pytest.MonkeyPatch, case: str, rebuild_data: bool
) -> None:
    models: dict[str, type[BaseModel]] = {"A": _A, "B": _B, "C": _C}
    rb = rebuild_data
    if case == "shards-overlap-types":
        specs = [
            (0, MS, _mixed_rows(120, 1), models, rb),
            (0, MS + 100, _mixed_rows(40, 2), models, rb),  # overlaps the one before
            (1, MS + 5, _mixed_rows(120, 3), models, rb),
            (2, MS + 7, _mixed_rows(60, 4), None, rb),  # untyped
        ]
    elif case == "invalid-mid-batch":
        specs = [
            (0, MS, _mixed_rows(120, 5, bad_at=61), models, rb),
            (1, MS + 3, _mixed_rows(90, 6), models, rb),
        ]
    else:  # written with _A, replayed with a model of the same module:QualName that changed
        specs = [(0, MS, [("A", {"a": i, "s": str(i)}) for i in range(50)], {"A": _A}, rb)]
        changed = _AFewer if case == "model-fewer-fields" else _AMore
        models = {"A": changed}
    store = _segments(specs)
    monkeypatch.setattr(replay_module, "BATCH_ROWS", 64)  # batches; an overlap sliced mid-batch
    built: list[int] = []
    kinds = replay_columns_module._kinds

    def counted(*args: Any, **kwargs: Any) -> Any:
        got = kinds(*args, **kwargs)
        built.append(sum(k is not None for k in got))
        return got

    monkeypatch.setattr(replay_columns_module, "_kinds", counted)
    got = _replayed(store, models)
    monkeypatch.setattr(replay_module, "ColumnReplay", _NoColumns)
    want = _replayed(store, models)

    assert got == want
    # a required field the payloads lack fails validation (DecodeError) on both paths
    assert (want[1] is not None) == (case in ("invalid-mid-batch", "model-more-fields"))
    assert (sum(built) > 0) == case.startswith(("shards", "invalid"))  # the column path ran
