"""A typed segment leaves out the ``data`` its typed columns rebuild, and every read gives the
entries' bytes back exactly: flights, a nested model (property), payloads that do not
round-trip (kept), segments of the previous format, and damaged rebuild metadata."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from eventbus.protocol.codec import F_DATA, Envelope, encode_entry, envelope_of, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.tier import rebuild
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.segment import SCHEMA
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.typed import TypedPayloads

MS = 1_700_000_000_000


class Item(BaseModel):
    sku: str
    qty: int
    tags: list[str]


class Address(BaseModel):
    city: str
    zip: str | None = None


class Order(BaseModel):
    order: int
    total: float
    paid: bool
    to: Address
    items: list[Item]
    note: str | None = None


Entries = list[tuple[EntryId, dict[bytes, bytes]]]


def _entries(
    events: Sequence[tuple[str, BaseModel]], headers: dict[str, str] | None = None
) -> Entries:
    out: Entries = []
    for i, (rid, event) in enumerate(events):
        out.append((EntryId(MS + i, i % 3), encode_entry(envelope_of(rid, event, headers))))
    return out


def _round_trip(entries: Entries, typed: TypedPayloads) -> tuple[list[bytes], int]:
    """The ``data`` the tier's reader gives for `entries` written as a typed segment, and how
    many entries the file holds without their ``data``."""
    data, info = encode_segment(
        "t", 0, entries[0][0], entries[-1][0], entries, typed=typed, rebuild_data=True
    )
    table, again = decode_segment(data, "k", expect=("t", 0, entries[0][0], entries[-1][0]))
    assert again == info
    return table.column("data").to_pylist(), info.data_rebuilt


def test_flights_segments_hold_no_data_and_give_it_back_byte_for_byte() -> None:
    from examples.flights.flightdata import Flight, load_flights

    entries = _entries([(r.plane, r.event()) for r in load_flights(limit=3000)])
    got, rebuilt = _round_trip(entries, TypedPayloads({"flights.Flight": Flight}))
    assert rebuilt == len(entries)
    assert got == [f[F_DATA] for _, f in entries]


_text = st.text(max_size=12)
_orders = st.builds(
    Order,
    order=st.integers(-(2**63), 2**63 - 1),
    total=st.floats(allow_nan=False),
    paid=st.booleans(),
    to=st.builds(Address, city=_text, zip=st.none() | _text),
    items=st.lists(
        st.builds(Item, sku=_text, qty=st.integers(-(2**40), 2**40), tags=st.lists(_text)),
        max_size=3,
    ),
    note=st.none() | _text,
)


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    orders=st.lists(_orders, min_size=1, max_size=20),
    headers=st.none() | st.dictionaries(_text, _text, max_size=3),
)
def test_nested_payloads_are_rebuilt_byte_for_byte(
    orders: list[Order], headers: dict[str, str] | None
) -> None:
    entries = _entries([(f"r{o.order}", o) for o in orders], headers)
    got, rebuilt = _round_trip(entries, TypedPayloads({None: Order}))
    assert got == [f[F_DATA] for _, f in entries]
    # model_dump(mode="json") payloads always round-trip; bodies of 1 KiB and more are zstd
    # frames (format 0x02), kept as they are
    assert rebuilt == sum(f[F_DATA][0] == 1 for _, f in entries)


def _raw(i: int, payload: object, etype: str = "Order") -> tuple[EntryId, dict[bytes, bytes]]:
    env = Envelope(f"r{i}", etype, new_event_id(), MS + i, {}, payload)
    return EntryId(MS + i, 0), encode_entry(env)


def test_payloads_that_do_not_round_trip_keep_their_data() -> None:
    base = Order(order=1, total=2.5, paid=True, to=Address(city="x"), items=[]).model_dump(
        mode="json"
    )
    odd = [
        {**base, "extra": 1},  # a field the model does not have
        {**base, "total": 3},  # an int where the model says float (validated to 3.0)
        {k: base[k] for k in reversed(base)},  # another key order
        {k: v for k, v in base.items() if k != "note"},  # a default left out
        {**base, "order": "nope"},  # does not validate
        base,  # round-trips
    ]
    entries = [_raw(i, p) for i, p in enumerate(odd)]
    entries.append(_raw(9, base, "Other"))  # a type without a model
    data, info = encode_segment(
        "t",
        0,
        entries[0][0],
        entries[-1][0],
        entries,
        typed=TypedPayloads({"Order": Order}),
        rebuild_data=True,
    )
    stored = pq.read_table(io.BytesIO(data)).column("data").to_pylist()
    assert [d is None for d in stored] == [False] * 5 + [True, False]
    assert info.data_rebuilt == 1
    table, _ = decode_segment(data, "k")
    assert table.column("data").to_pylist() == [f[F_DATA] for _, f in entries]


def test_floats_keep_their_bits() -> None:
    values = [0.0, -0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308, 0.1 + 0.2]
    entries = [
        _raw(
            i,
            {
                "order": i,
                "total": v,
                "paid": False,
                "to": {"city": "c", "zip": None},
                "items": [],
                "note": None,
            },
        )
        for i, v in enumerate(values)
    ]
    got, rebuilt = _round_trip(entries, TypedPayloads({"Order": Order}))
    assert got == [f[F_DATA] for _, f in entries] and rebuilt == len(values)


def test_a_segment_of_the_previous_typed_format_is_read_as_written() -> None:
    """Version 2 (typed columns beside a complete ``data``), as offloaders before version 3
    wrote it: the reader takes ``data`` from the file."""
    entries = _entries([(f"r{i}", Item(sku=f"s{i}", qty=i, tags=[])) for i in range(5)])
    data, _ = encode_segment(
        "t",
        0,
        entries[0][0],
        entries[-1][0],
        entries,
        typed=TypedPayloads({None: Item}),
        rebuild_data=True,
    )
    table, _ = decode_segment(data, "k")  # the full data column, rebuilt
    typed = pq.read_table(io.BytesIO(data), columns=["sku", "qty", "tags", "typed_error"])
    meta = dict(pq.read_schema(io.BytesIO(data)).metadata)
    meta[b"eventbus.segment_version"] = b"2"
    del meta[b"eventbus.data_fields"], meta[b"eventbus.data_rebuilt"]
    schema = pa.schema([*SCHEMA, *typed.schema], metadata=meta)  # ``data`` not nullable
    old = pa.Table.from_arrays([*table.columns, *typed.columns], schema=schema)
    sink = io.BytesIO()
    pq.write_table(old, sink)
    read, info = decode_segment(sink.getvalue(), "old")
    assert info.data_fields is None and info.typed_models is not None
    assert read.column("data").to_pylist() == [f[F_DATA] for _, f in entries]


def test_a_left_out_data_without_typed_values_is_a_corrupt_segment() -> None:
    entries = _entries([(f"r{i}", Item(sku=f"s{i}", qty=i, tags=[])) for i in range(3)])
    data, _ = encode_segment(
        "t",
        0,
        entries[0][0],
        entries[-1][0],
        entries,
        typed=TypedPayloads({None: Item}),
        rebuild_data=True,
    )
    table = pq.read_table(io.BytesIO(data))
    errors = pa.array(["lost", None, None], pa.string())
    damaged = table.set_column(table.column_names.index("typed_error"), "typed_error", errors)
    sink = io.BytesIO()
    pq.write_table(damaged.replace_schema_metadata(table.schema.metadata), sink)
    with pytest.raises(CorruptSegment, match="neither data nor typed values"):
        decode_segment(sink.getvalue(), "bad")


class Flat(BaseModel):
    """Scalars only: every MessagePack integer, float and string form."""

    n: int
    x: float
    ok: bool
    s: str
    maybe_n: int | None = None
    maybe_s: str | None = None


_EDGES = (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33, -128)
_edges = st.sampled_from([*_EDGES, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)])
_ints = _edges | st.integers(-(2**63), 2**63 - 1)
_strings = st.text(max_size=40) | st.sampled_from(["é" * 16, "a" * 255, "b" * 256, "c" * 70000])
_flats = st.builds(
    Flat,
    n=_ints,
    x=st.floats(allow_nan=False),
    ok=st.booleans(),
    s=_strings,
    maybe_n=st.none() | _ints,
    maybe_s=st.none() | _strings,
)


@settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(flats=st.lists(_flats, min_size=1, max_size=30), headers=st.booleans())
def test_scalar_payloads_of_every_msgpack_form_are_rebuilt_byte_for_byte(
    flats: list[Flat], headers: bool
) -> None:
    entries = _entries([(f"r{i}", f) for i, f in enumerate(flats)], {"k": "v"} if headers else None)
    got, rebuilt = _round_trip(entries, TypedPayloads({None: Flat}))
    assert got == [f[F_DATA] for _, f in entries]
    assert rebuilt == sum(f[F_DATA][0] == 1 for _, f in entries)


def test_an_entry_whose_envelope_does_not_decode_keeps_its_data() -> None:
    """A header value that is not text: the envelope columns are null (`decode_entry` refuses
    it) while the payload validates; nothing rebuilds such an entry, so its data stays."""
    good = Item(sku="s", qty=1, tags=[]).model_dump(mode="json")
    odd = Envelope("r1", "Item", new_event_id(), MS + 1, {"k": 1}, good)  # type: ignore[dict-item]
    entries = [_raw(0, good, "Item"), (EntryId(MS + 1, 0), encode_entry(odd))]
    data, info = encode_segment(
        *("t", 0, entries[0][0], entries[-1][0], entries),
        typed=TypedPayloads({"Item": Item}),
        rebuild_data=True,
    )
    stored = pq.read_table(io.BytesIO(data)).column("data").to_pylist()
    assert [d is None for d in stored] == [True, False] and info.data_rebuilt == 1
    table, _ = decode_segment(data, "k")
    assert table.column("data").to_pylist() == [f[F_DATA] for _, f in entries]


def test_a_left_out_count_unlike_the_metadata_is_a_corrupt_segment() -> None:
    entries = _entries([(f"r{i}", Item(sku=f"s{i}", qty=i, tags=[])) for i in range(3)])
    data, _ = encode_segment(
        *("t", 0, entries[0][0], entries[-1][0], entries),
        typed=TypedPayloads({None: Item}),
        rebuild_data=True,
    )
    table = pq.read_table(io.BytesIO(data))
    meta = {**table.schema.metadata, b"eventbus.data_rebuilt": b"2"}
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(meta), sink)
    with pytest.raises(CorruptSegment, match="3 entries without data, metadata says 2"):
        decode_segment(sink.getvalue(), "bad")


def test_data_is_left_out_exactly_where_rebuilding_gives_it_back() -> None:
    """A page of one model decoded into its msgspec mirror (the offloader's one pass) leaves
    out the ``data`` of the entries whose bodies encode again to the same bytes; that is
    exactly where rebuilding from the written columns (`rebuild.unneeded`) gives them back,
    also for bodies no publisher writes: integers and floats in wider forms, an int where the
    model says float."""
    flat = Flat(n=5, x=0.5, ok=True, s="s", maybe_n=7).model_dump(mode="json")
    canonical = [_raw(i, flat, "Flat") for i in range(3)]
    wide_int = _with(canonical[0], b"\xa1n\x05", b"\xa1n\xcd\x00\x05")
    float32 = _with(canonical[1], b"\xa1x\xcb?\xe0" + bytes(6), b"\xa1x\xca?\x00\x00\x00")
    int_for_float = _raw(3, {**flat, "x": 3}, "Flat")
    entries = [*canonical, wide_int, float32, int_for_float]
    entries = [(EntryId(MS + i, 0), f) for i, (_, f) in enumerate(entries)]
    typed = TypedPayloads({"Flat": Flat})
    assert typed.mirrors["Flat"] is not None
    data, info = encode_segment(
        "t", 0, entries[0][0], entries[-1][0], entries, typed=typed, rebuild_data=True
    )
    table = pq.read_table(io.BytesIO(data))
    stored = table.column("data").to_pylist()
    assert [d is None for d in stored] == [True] * 3 + [False] * 3 and info.data_rebuilt == 3
    columns = {n: table.column(n).combine_chunks() for n in table.column_names}
    full = pa.array([f[F_DATA] for _, f in entries], pa.binary())
    fields = rebuild.rebuildable(typed)
    by_rebuild = rebuild.unneeded(
        fields, full, columns["event_type"], columns["typed_error"], columns
    )
    assert [d is None for d in by_rebuild.to_pylist()] == [d is None for d in stored]
    assert decode_segment(data, "k")[0].column("data").to_pylist() == full.to_pylist()


def _with(
    e: tuple[EntryId, dict[bytes, bytes]], old: bytes, new: bytes
) -> tuple[EntryId, dict[bytes, bytes]]:
    """`e` with `old` replaced by `new` in its ``data`` (once, and it must be there)."""
    assert e[1][F_DATA].count(old) == 1
    return e[0], {**e[1], F_DATA: e[1][F_DATA].replace(old, new)}


class Counter(BaseModel):
    n: int
    name: str


def test_a_payload_the_typed_columns_cannot_hold_keeps_its_data() -> None:
    # an int past int64 decodes into the model's mirror but Arrow refuses it: the row has a
    # typed error and null typed columns, so only its data can give its bytes back
    payloads = [
        {"n": 2**64 - 1, "name": "x"},
        {"n": 1, "name": ""},
        {"n": 2**63, "name": "y"},
    ]
    entries = [_raw(i, p, "Counter") for i, p in enumerate(payloads)]

    data, info = encode_segment(
        "t",
        0,
        entries[0][0],
        entries[-1][0],
        entries,
        typed=TypedPayloads({"Counter": Counter}),
        rebuild_data=True,
    )

    stored = pq.read_table(io.BytesIO(data)).column("data").to_pylist()
    assert [d is None for d in stored] == [False, True, False] and info.data_rebuilt == 1
    table, _ = decode_segment(data, "k")
    assert table.column("data").to_pylist() == [f[F_DATA] for _, f in entries]
