"""Typed segments: the pydantic -> Arrow mapping, typed columns next to the raw ``data``, invalid
entries, schema evolution, and the archive read by plain Parquet readers."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import io
import json
import uuid
from typing import Literal

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from eventbus.errors import ConfigError
from eventbus.protocol.codec import F_DATA, Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.tier.segment import SCHEMA
from eventbus.tier.segment_columns import entry_columns
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.typed import TypedPayloads, arrow_type, typed_struct
from eventbus.tier.typed_mirror import mirror_struct

MS = 1_700_000_000_000


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Line(BaseModel):
    sku: str
    qty: int


class Placed(BaseModel):
    order: int
    amount: float
    at: dt.datetime
    lines: list[Line] = Field(default_factory=list)
    colour: Colour = Colour.RED
    note: str | None = None


class Cancelled(BaseModel):
    order: int
    reason: str


class PlacedV2(Placed):  # a field added with a default
    channel: str = "web"


class PlacedAmountText(BaseModel):  # a changed type
    order: int
    amount: str


def entry(i: int, etype: str, payload: dict[str, object]) -> tuple[EntryId, dict[bytes, bytes]]:
    env = Envelope(f"r{i}", etype, new_event_id(), MS + i, {}, payload)
    return EntryId(MS + i, 0), encode_entry(env)


def placed(i: int) -> dict[str, object]:
    return {
        "order": i,
        "amount": i * 1.5,
        "at": f"2026-11-24T10:00:0{i % 10}Z",
        "lines": [{"sku": f"s{i}", "qty": i}],
        "colour": "blue",
    }


def test_the_pydantic_to_arrow_mapping() -> None:
    """The table of docs/protocol.md, "Typed columns"."""
    assert arrow_type(int) == pa.int64()
    assert arrow_type(float) == pa.float64()
    assert arrow_type(bool) == pa.bool_()
    assert arrow_type(bytes) == pa.binary()
    assert arrow_type(dt.datetime) == pa.timestamp("us", tz="UTC")
    assert arrow_type(dt.date) == pa.date32()
    assert arrow_type(int | None) == pa.int64()
    assert arrow_type(int | str) == pa.string()
    assert arrow_type(Colour) == pa.string()
    assert arrow_type(Literal[1, 2]) == pa.int64()
    assert arrow_type(decimal.Decimal) == pa.string()
    assert arrow_type(uuid.UUID) == pa.string()
    assert arrow_type(list[Line]) == pa.list_(
        pa.struct([("sku", pa.string()), ("qty", pa.int64())])
    )
    assert arrow_type(tuple[int, ...]) == pa.list_(pa.int64())
    assert arrow_type(dict[str, float]) == pa.map_(pa.string(), pa.float64())
    assert typed_struct({"Placed": Placed, "Cancelled": Cancelled}).names == [
        *Placed.model_fields,
        "reason",
    ]


def test_models_that_clash_or_shadow_a_fixed_column_are_refused() -> None:
    class Shadow(BaseModel):
        data: str

    with pytest.raises(ConfigError, match="fixed column"):
        typed_struct({None: Shadow})
    with pytest.raises(ConfigError, match="'amount' is double in one model and string"):
        typed_struct({"Placed": Placed, "Other": PlacedAmountText})


def test_a_typed_segment_keeps_data_and_adds_typed_columns() -> None:
    typed = TypedPayloads({"Placed": Placed, "Cancelled": Cancelled})
    entries = [
        entry(0, "Placed", placed(0)),
        entry(1, "Cancelled", {"order": 0, "reason": "late"}),
        entry(2, "Placed", {"order": "not a number"}),  # does not validate
        entry(3, "Shipped", {"order": 0}),  # no model: null typed columns, no error
    ]
    data, info = encode_segment("orders", 0, entries[0][0], entries[-1][0], entries, typed=typed)
    assert (info.typed_invalid, info.typed_version) == (1, typed.version)
    table = pq.read_table(io.BytesIO(data))
    meta = table.schema.metadata
    assert meta[b"eventbus.segment_version"] == b"2"
    assert json.loads(meta[b"eventbus.typed_models"]) == {
        "Placed": f"{__name__}:Placed",
        "Cancelled": f"{__name__}:Cancelled",
    }
    assert meta[b"eventbus.typed_invalid"] == b"1"
    rows = table.to_pylist()
    assert rows[0]["order"] == 0 and rows[0]["amount"] == 0.0
    assert rows[0]["at"] == dt.datetime(2026, 11, 24, 10, 0, 0, tzinfo=dt.UTC)
    assert rows[0]["lines"] == [{"sku": "s0", "qty": 0}] and rows[0]["colour"] == "blue"
    assert rows[1]["reason"] == "late" and rows[1]["amount"] is None
    assert rows[2]["order"] is None and "ValidationError: Placed: order" in rows[2]["typed_error"]
    assert rows[3]["order"] is None and rows[3]["typed_error"] is None
    assert [r["typed_error"] is None for r in rows] == [True, True, False, True]
    assert [r["data"] for r in rows] == [e[1][F_DATA] for e in entries]  # the source of truth
    # the tier's own reader still verifies it and reads the raw columns
    table2, info2 = decode_segment(data, "k", expect=("orders", 0, entries[0][0], entries[-1][0]))
    assert table2.column_names == list(SCHEMA.names) and info2 == info


def test_typed_columns_of_a_page_equal_those_built_entry_by_entry() -> None:
    """Payloads decoded once with the envelope and validated per page and model give the
    struct that decoding each payload again gives (nested models, enums, datetimes, invalid
    payloads, types without a model)."""
    typed = TypedPayloads({"Placed": Placed, "Cancelled": Cancelled})
    payloads: list[tuple[str, dict[str, object]]] = [
        ("Placed", placed(0)),
        ("Cancelled", {"order": 1, "reason": "late"}),
        ("Placed", {"order": "x"}),
        ("Shipped", {"order": 3}),
    ]
    rows = [entry(i, *payloads[i % 4]) for i in range(40)]
    ids = [str(i).encode() for i, _ in rows]
    fields = [[x for kv in f.items() for x in kv] for _, f in rows]
    paged = entry_columns("orders", 0, ids, fields, typed)
    odd = [b"rid", b"r", b"type", b"Placed", b"data", b"\x09junk"]  # sends the page entry by entry
    single = entry_columns("orders", 0, [*ids, b"9999999999999-0"], [*fields, odd], typed)
    assert single.typed is not None and paged.typed is not None
    assert single.typed.slice(0, 40).to_pylist() == paged.typed.to_pylist()
    assert single.typed_errors is not None and single.typed_errors[:40] == paged.typed_errors
    assert single.typed_errors[40] is not None and single.typed_errors[40].startswith("DecodeError")
    assert paged.typed_errors is not None and paged.typed_errors.count(None) == 30


@pytest.mark.parametrize("model", [Cancelled, Placed], ids=["msgspec mirror", "pydantic"])
def test_a_value_arrow_cannot_hold_is_a_typed_error_not_a_failed_segment(
    model: type[BaseModel],
) -> None:
    # pydantic's int is unbounded and MessagePack carries up to 2**64 - 1: an order number of
    # 2**63 validates, but no int64 column holds it; the segment is written all the same
    typed = TypedPayloads({model.__name__: model})
    big = {**placed(1), "order": 2**63, "reason": "x"}
    entries = [
        entry(0, model.__name__, {**placed(0), "reason": "x"}),
        entry(1, model.__name__, big),
        entry(2, model.__name__, {**placed(2), "reason": "x"}),
    ]
    data, info = encode_segment("orders", 0, entries[0][0], entries[-1][0], entries, typed=typed)
    rows = pq.read_table(io.BytesIO(data)).to_pylist()
    assert [r["order"] for r in rows] == [0, None, 2]
    assert rows[1]["typed_error"].startswith("OverflowError")
    assert info.typed_invalid == 1
    assert [r["data"] for r in rows] == [e[1][F_DATA] for e in entries]  # nothing lost


def test_a_typed_segment_with_a_forged_schema_is_corrupt() -> None:
    typed = TypedPayloads({None: Cancelled})
    entries = [entry(0, "Cancelled", {"order": 1, "reason": "x"})]
    data, _ = encode_segment("orders", 0, entries[0][0], entries[0][0], entries, typed=typed)
    table = pq.read_table(io.BytesIO(data)).drop_columns(["typed_error"])
    sink = io.BytesIO()
    pq.write_table(table, sink)
    from eventbus.tier.errors import CorruptSegment

    with pytest.raises(CorruptSegment, match="unexpected schema"):
        decode_segment(sink.getvalue(), "k")


def test_schema_evolution_new_column_and_new_version(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A field added with a default is a new column (null in older segments, read together by
    a schema-merging reader); a changed type is another typed_version, never a rewrite."""
    v1, v2 = TypedPayloads({"Placed": Placed}), TypedPayloads({"Placed": PlacedV2})
    changed = TypedPayloads({"Placed": PlacedAmountText})
    assert len({v1.version, v2.version, changed.version}) == 3
    folder = tmp_path / "orders" / "0"
    folder.mkdir(parents=True)
    for n, typed in enumerate((v1, v2)):
        rows = [entry(10 * n + i, "Placed", {**placed(i), "channel": "app"}) for i in range(3)]
        data, _ = encode_segment("orders", 0, rows[0][0], rows[-1][0], rows, typed=typed)
        (folder / f"{n}.parquet").write_bytes(data)
    (folder.parent / "0" / "gaps").mkdir()
    (folder / "gaps" / "x.json").write_text("{}")  # the glob of docs/spark.md skips it
    got = duckdb.sql(
        f"SELECT entry_ms, \"order\", channel FROM read_parquet('{tmp_path}/orders/*/*.parquet',"
        " union_by_name = true) ORDER BY entry_ms"
    ).fetchall()
    assert [(r[1], r[2]) for r in got] == [(i, None) for i in range(3)] + [
        (i, "app") for i in range(3)
    ]


def test_per_type_models_as_docs_tier_md_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tier.md's ``EVENTBUS_TIER_TYPED_MODELS='{"orders": {"OrderPlaced": "..."}}'`` (a
    nested object) was a ValidationError: only the per-type object as JSON *text* was taken."""
    from eventbus.tier.settings import TierSettings
    from eventbus.tier.typed import load_models

    here = f"{__name__}:Placed"
    monkeypatch.setenv(
        "EVENTBUS_TIER_TYPED_MODELS",
        json.dumps({"orders": {"Placed": here, "Cancelled": f"{__name__}:Cancelled"}}),
    )
    nested = TierSettings().typed_models["orders"]
    assert load_models(nested) == {"Placed": Placed, "Cancelled": Cancelled}
    # the other forms still work: one model for every type, and the object as text
    monkeypatch.setenv("EVENTBUS_TIER_TYPED_MODELS", json.dumps({"orders": here}))
    assert load_models(TierSettings().typed_models["orders"]) == {None: Placed}
    as_text = TierSettings(typed_models={"orders": json.dumps({"Placed": here})})
    assert load_models(as_text.typed_models["orders"]) == {"Placed": Placed}


class Reading(BaseModel):  # simple enough for a msgspec mirror
    sensor: str
    value: float
    count: int
    ok: bool | None
    unit: str = "C"


class Checked(Reading):
    @field_validator("count")
    @classmethod
    def _positive(cls, v: int) -> int:
        return abs(v)


class Bounded(BaseModel):
    count: int = Field(gt=0)


class Aliased(BaseModel):
    count: int = Field(alias="n")


class Forbidding(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int


class Stripping(BaseModel):
    model_config = ConfigDict(str_strip_whitespace=True)
    name: str


def test_only_models_validated_alike_by_msgspec_get_a_mirror() -> None:
    mirror = mirror_struct(Reading)
    assert mirror is not None and mirror.__struct_fields__ == tuple(Reading.model_fields)
    default = mirror(sensor="s", value=1.0, count=1, ok=None).unit  # type: ignore[attr-defined]
    assert default == "C"
    for model in (Checked, Bounded, Aliased, Forbidding, Stripping, Placed):
        assert mirror_struct(model) is None, model
    assert mirror_struct(Cancelled) is not None  # int and str fields only


def test_payloads_decoded_into_a_mirror_give_the_columns_pydantic_gives() -> None:
    """A page of one mirrored model is validated by msgspec as it is decoded; what msgspec
    refuses is validated by pydantic (lax: "3" and True for an int, 2.0 for an int). The typed
    columns and errors equal those of validating every payload with pydantic."""
    typed = TypedPayloads({"Reading": Reading})
    good = {"sensor": "a", "value": 1.5, "count": 2, "ok": True}
    payloads: list[dict[str, object]] = [
        good,
        {**good, "value": 3},  # an int for a float: 3.0 in both
        {**good, "count": "3"},  # lax: pydantic only
        {**good, "count": True},
        {**good, "count": 2.0},
        {**good, "count": 2.5},  # invalid
        {"sensor": "b", "value": 0.5, "count": 1},  # missing ok: invalid (required)
        {**good, "extra": [1, 2]},  # ignored
        {**good, "unit": "K", "ok": None},
    ]
    rows = [entry(i, "Reading", payloads[i % len(payloads)]) for i in range(45)]
    ids = [str(i).encode() for i, _ in rows]
    fields = [[x for kv in f.items() for x in kv] for _, f in rows]
    paged = entry_columns("r", 0, ids, fields, typed)
    by_pydantic, errors = typed.columns([f[F_DATA] for _, f in rows], ["Reading"] * len(rows))
    assert paged.typed is not None and paged.typed.to_pylist() == by_pydantic.to_pylist()
    assert paged.typed_errors == errors and errors.count(None) == 35
    assert paged.typed.field("value").to_pylist()[1] == 3.0
    # all valid and as msgspec wants them: one pass, the same columns
    clean = [entry(i, "Reading", good) for i in range(5)]
    ids = [str(i).encode() for i, _ in clean]
    fields = [[x for kv in f.items() for x in kv] for _, f in clean]
    fast = entry_columns("r", 0, ids, fields, typed)
    assert fast.typed is not None and fast.bodies is not None
    assert {type(b.p) for b in fast.bodies} == {typed.mirrors["Reading"]}
    assert fast.typed.to_pylist() == [{**good, "unit": "C"}] * 5
