"""Durable tier, pure parts: entry IDs and key order, the segment format, gap arithmetic."""

from __future__ import annotations

import io
import random
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from eventbus.errors import ConfigError
from eventbus.protocol.codec import Envelope, decode_entry, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.gaps import find_gap
from eventbus.tier.layout import gap_key, parse_gap_key, parse_segment_key, segment_key
from eventbus.tier.segment import SCHEMA
from eventbus.tier.segment_bodies import _decode_all
from eventbus.tier.segment_columns import entry_columns
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.segment_write import encode_segment, write_parquet
from eventbus.tier.typed import TypedPayloads


def entry(
    i: int, ms: int = 1_700_000_000_000, **headers: str
) -> tuple[EntryId, dict[bytes, bytes]]:
    env = Envelope(f"r{i % 7}", "Tick", new_event_id(), ms + i, dict(headers), {"seq": i})
    return EntryId(ms + i // 3, i % 3), encode_entry(env)


# -- ids and keys ------------------------------------------------------------------------------
def test_parse_and_format_ids() -> None:
    assert parse_id("1700000000000-5") == EntryId(1_700_000_000_000, 5)
    assert parse_id(b"7-0") == EntryId(7, 0) == parse_id("7")
    assert str(EntryId(9, 1)) == "9-1"
    assert EntryId(9, 1).next() == EntryId(9, 2)
    assert EntryId(9, 0).prev() == EntryId(8, (1 << 64) - 1)
    assert EntryId(8, (1 << 64) - 1).next() == EntryId(9, 0)
    with pytest.raises(ConfigError, match="not a stream entry ID"):
        parse_id("abc")


def test_keys_sort_by_entry_id_as_text() -> None:
    """Plain text order of keys (what object store listings give) equals entry-ID order, where
    unpadded IDs would not: "9-0" sorts after "10-0" as text."""
    rng = random.Random(4)
    ids = sorted(
        {
            EntryId(rng.choice([9, 10, 99, 1_700_000_000_000]), rng.randrange(0, 1000))
            for _ in range(200)
        }
    )
    keys = [segment_key("orders", 3, i, i) for i in ids]
    assert sorted(keys) == keys
    assert [parse_segment_key(k).first for k in keys] == ids  # type: ignore[union-attr]
    assert sorted(str(i) for i in ids) != [str(i) for i in ids]  # why the padding is needed


def test_key_layout_round_trips() -> None:
    first, last = EntryId(1, 2), EntryId(3, 4)
    key = segment_key("orders", 12, first, last)
    assert key == (
        "orders/shard=12/00000000000000000001-00000000000000000002-"
        "00000000000000000003-00000000000000000004.parquet"
    )
    ref = parse_segment_key("some/prefix/" + key, size=10)
    assert ref is not None and (ref.topic, ref.shard, ref.first, ref.last, ref.size) == (
        "orders",
        12,
        first,
        last,
        10,
    )
    gkey = gap_key("orders", 12, first, last)
    assert gkey.startswith("orders/shard=12/_gaps/") and parse_gap_key(gkey) == (first, last)
    assert parse_segment_key(gkey) is None
    assert parse_segment_key("orders/shard=12/tmp#1") is None
    assert parse_segment_key("orders/shard=x/" + key.rsplit("/", 1)[1]) is None


def test_segment_keys_of_the_earlier_layout_still_parse() -> None:
    """Segments stored before the Hive-style folders (``<topic>/<shard>/``) name the same
    range and shard."""
    first, last = EntryId(1, 2), EntryId(3, 4)
    name = segment_key("orders", 12, first, last).rsplit("/", 1)[1]
    ref = parse_segment_key(f"orders/12/{name}")
    assert ref is not None and (ref.topic, ref.shard, ref.first, ref.last) == (
        "orders",
        12,
        first,
        last,
    )
    assert parse_segment_key(f"orders/12/gaps/{name}") is None


# -- segments -----------------------------------------------------------------------------------
def test_segment_round_trip_and_plain_pandas_read() -> None:
    rows = [entry(i, trace="t") for i in range(500)]
    bad = (EntryId(1_800_000_000_000, 0), {b"rid": b"x", b"type": b"T", b"data": b"\x09junk"})
    rows.append(bad)
    data, info = encode_segment("orders", 2, rows[0][0], rows[-1][0], rows)
    assert (info.entries, info.first, info.last) == (501, rows[0][0], rows[-1][0])
    assert info.raw_bytes == sum(len(k) + len(v) for _, f in rows for k, v in f.items())

    table, info2 = decode_segment(data, "k", expect=("orders", 2, rows[0][0], rows[-1][0]))
    assert info2 == info and table.schema.remove_metadata() == SCHEMA.remove_metadata()

    # pandas reads it with no eventbus code; the data column decodes with the codec
    df = pd.read_parquet(io.BytesIO(data))
    assert list(df.columns) == SCHEMA.names
    assert df["entry_id"].tolist() == [str(i) for i, _ in rows]
    assert df["resource_id"].iloc[3] == "r3" and df["event_type"].iloc[3] == "Tick"
    assert df["headers"].iloc[0] == [("trace", "t")]
    env = decode_entry({b"rid": b"r0", b"type": b"Tick", b"data": df["data"].iloc[0]})
    assert env.payload == {"seq": 0} and df["event_id"].iloc[0] == str(env.event_id)
    # an undecodable envelope is kept raw, with null envelope columns
    assert df["data"].iloc[-1] == b"\x09junk" and df["headers"].iloc[-1] is None
    assert pd.isna(df["event_time_ms"].iloc[-1])
    meta = pq.read_metadata(io.BytesIO(data)).metadata
    assert meta[b"eventbus.entries"] == b"501"


def test_segments_have_a_page_index_and_segments_without_one_read_alike() -> None:
    """Every column chunk has a page index (column and offset index: a reader given an
    ``entry_ms`` range skips the pages outside it), and a segment of the earlier layout (no
    page index, pages of up to 20,000 rows) decodes to the same rows."""
    rows = [entry(i, trace="t") for i in range(5000)]
    first, last = rows[0][0], rows[-1][0]
    data, _ = encode_segment("orders", 2, first, last, rows)
    meta = pq.read_metadata(io.BytesIO(data))
    chunks = [
        meta.row_group(g).column(c)
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    ]
    assert chunks and all(c.has_column_index and c.has_offset_index for c in chunks)

    table, info = decode_segment(data, "k", expect=("orders", 2, first, last))
    earlier = write_parquet(pq.read_table(io.BytesIO(data)), page_rows=20000, page_index=False)
    assert not pq.read_metadata(io.BytesIO(earlier)).row_group(0).column(0).has_column_index
    assert decode_segment(earlier, "k", expect=("orders", 2, first, last)) == (table, info)
    # a range read by entry_ms gives the rows of the range
    lo, hi = rows[1000][0].ms, rows[3000][0].ms
    ranged = pq.read_table(
        io.BytesIO(data), filters=[("entry_ms", ">=", lo), ("entry_ms", "<=", hi)]
    )
    assert ranged.column("entry_id").to_pylist() == [str(i) for i, _ in rows if lo <= i.ms <= hi]


def raw_reply(rows: list[tuple[EntryId, dict[bytes, bytes]]]) -> tuple[list[bytes], list[list]]:
    """`rows` as a single node's raw XRANGE reply gives them: ID bytes, [name, value, ...]."""
    return [str(i).encode() for i, _ in rows], [
        [x for kv in f.items() for x in kv] for _, f in rows
    ]


def columns_table(topic: str, ids: list, fields: list) -> pa.Table:
    return pa.Table.from_arrays(entry_columns(topic, 0, ids, fields).arrays, schema=SCHEMA)


def test_columns_built_for_a_page_equal_those_built_entry_by_entry() -> None:
    """The page path (raw XRANGE rows, decoded column by column) gives the rows the entry by
    entry path gives: one entry that is not the common case sends a page down that path."""
    rows = [entry(i, trace=f"t{i}") if i % 4 == 0 else entry(i) for i in range(300)]
    ids, fields = raw_reply(rows)
    paged = columns_table("orders", ids, fields)
    odd = [b"rid", b"x", b"type", b"T", b"data", b"\x09junk"]  # undecodable: entry by entry
    one_by_one = columns_table("orders", [*ids, b"1800000000000-0"], [*fields, odd])
    assert one_by_one.slice(0, 300).to_pylist() == paged.to_pylist()
    as_maps = columns_table("orders", [str(i) for i, _ in rows], [f for _, f in rows])
    assert as_maps.to_pylist() == paged.to_pylist()
    for row, (entry_id, f) in zip(paged.to_pylist(), rows, strict=True):
        env = decode_entry(f)
        assert (row["entry_id"], row["entry_ms"], row["entry_seq"]) == (
            str(entry_id),
            entry_id.ms,
            entry_id.seq,
        )
        assert row["event_id"] == str(env.event_id)
        assert row["event_time_ms"] == env.published_at_ms
        assert dict(row["headers"]) == env.headers and row["data"] == f[b"data"]
        assert (row["resource_id"], row["event_type"]) == (env.resource_id, env.event_type)


def test_entries_that_are_not_the_common_case_keep_their_raw_fields() -> None:
    big = Envelope("r", "Big", new_event_id(), 5, {}, {"text": "x" * 5000})  # zstd, 0x02
    rows: list[list[bytes]] = [
        [b"rid", b"r1", b"type", b"T", b"data", b"\x09junk"],  # unknown format byte
        [b"rid", b"\xff", b"type", b"T", b"data", encode_entry(big)[b"data"]],
        [b"type", b"T", b"rid", b"r3", b"data", encode_entry(big)[b"data"], b"extra", b"e"],
        [b"rid", b"r4", b"type", b"T"],  # no data field
    ]
    table = columns_table("t", [b"1-0", b"1-1", b"2-0", b"3-0"], rows).to_pylist()
    assert [r["data"] for r in table] == [rows[0][5], rows[1][5], rows[2][5], b""]
    assert [r["resource_id"] for r in table] == ["r1", None, "r3", "r4"]
    # a bad rid or format, or no data: no envelope; another field order or more fields: decoded
    assert [r["event_time_ms"] for r in table] == [None, None, 5, None]
    assert table[2]["event_id"] == str(big.event_id) and table[2]["headers"] == []
    assert entry_columns("t", 0, [b"1-0"], [rows[2]]).raw_bytes == sum(map(len, rows[2]))


def test_field_lists_with_the_names_elsewhere_are_read_by_name() -> None:
    """A page of six-field lists whose names are not all in XADD's order (here one entry's
    ``rid`` and ``type`` swapped) is not sliced by position: every entry's values are read by
    name, so no value lands in another field's column."""
    rows = [entry(i) for i in range(5)]
    ids, fields = raw_reply(rows)
    f = fields[2]
    fields[2] = [f[2], f[3], f[0], f[1], f[4], f[5]]  # type, T, rid, r, data, d
    table = columns_table("t", ids, fields).to_pylist()
    assert [r["resource_id"] for r in table] == [f"r{i % 7}" for i in range(5)]
    assert {r["event_type"] for r in table} == {"Tick"}


def test_a_page_is_decoded_in_one_pass_only_when_every_entry_is_the_common_case() -> None:
    """`_decode_all` gives every body of a page of plain envelopes (format ``0x01``), and None
    (the page then goes entry by entry) when one entry is missing a field or has another
    format."""
    rows = [entry(i) for i in range(4)]
    _, fields = raw_reply(rows)
    rids, types, datas = [f[1] for f in fields], [f[3] for f in fields], [f[5] for f in fields]
    bodies = _decode_all(rids, types, datas, None)
    assert bodies is not None
    assert [b.ts for b in bodies] == [decode_entry(f).published_at_ms for _, f in rows]
    assert _decode_all([*rids, None], [*types, b"T"], [*datas, datas[0]], None) is None
    assert _decode_all([*rids, b"r"], [*types, b"T"], [*datas, b"\x09junk"], None) is None


def test_a_payload_string_that_is_not_utf8_is_archived_raw() -> None:
    """An envelope whose payload holds bytes that are not UTF-8 where a string belongs (a
    foreign writer) neither stops the segment nor loses the entry: `data` is kept; the typed
    columns say why they are null."""
    good = entry(1)
    payload_key = b"\xa3seq"  # the payload's key "seq", a MessagePack fixstr
    assert payload_key in good[1][b"data"]
    bad_data = good[1][b"data"].replace(payload_key, b"\xa3\xff\xfeq")
    rows = [good, (EntryId(good[0].ms + 1, 0), {**good[1], b"data": bad_data})]
    data, info = encode_segment("t", 0, rows[0][0], rows[-1][0], rows)
    table = pq.read_table(io.BytesIO(data)).to_pylist()
    assert info.entries == 2 and table[1]["data"] == bad_data

    class Tick(BaseModel):
        seq: int

    data, info = encode_segment(
        "t", 0, rows[0][0], rows[-1][0], rows, typed=TypedPayloads({None: Tick})
    )
    table = pq.read_table(io.BytesIO(data)).to_pylist()
    assert table[0]["seq"] == 1 and table[0]["typed_error"] is None
    assert table[1]["seq"] is None and table[1]["typed_error"].startswith("DecodeError")
    assert table[1]["event_id"] is None and table[1]["data"] == bad_data


def test_encode_rejects_disorder() -> None:
    a, b = entry(1), entry(2)
    with pytest.raises(ValueError, match="out of order"):
        encode_segment("t", 0, a[0], b[0], [b, a])
    with pytest.raises(ValueError, match="outside"):
        encode_segment("t", 0, b[0], b[0], [a])


@pytest.mark.parametrize(
    "damage",
    ["flip_middle", "truncate_tail", "truncate_head", "empty", "not_parquet"],
)
def test_corrupt_segments_raise_naming_the_object(damage: str) -> None:
    rows = [entry(i) for i in range(2000)]
    data, _ = encode_segment("t", 0, rows[0][0], rows[-1][0], rows)
    broken = {
        "flip_middle": data[: len(data) // 2]
        + bytes([data[len(data) // 2] ^ 0x55])
        + data[len(data) // 2 + 1 :],
        "truncate_tail": data[:-50],
        "truncate_head": data[100:],
        "empty": b"",
        "not_parquet": b"hello world" * 10,
    }[damage]
    with pytest.raises(CorruptSegment, match=re.escape("t/0/seg.parquet")):
        decode_segment(broken, "t/0/seg.parquet")


def test_segment_metadata_must_match_its_key() -> None:
    rows = [entry(i) for i in range(10)]
    data, _ = encode_segment("t", 0, rows[0][0], rows[-1][0], rows)
    with pytest.raises(CorruptSegment, match="the key says"):
        decode_segment(data, "k", expect=("t", 1, rows[0][0], rows[-1][0]))


# -- gap arithmetic -----------------------------------------------------------------------------
def info(
    first: str | None, length: int, added: int, last: str = "50-0", deleted: str = "0-0"
) -> dict:
    return {
        "first-entry": None if first is None else (first.encode(), {}),
        "length": length,
        "entries-added": added,
        "last-generated-id": last.encode(),
        "max-deleted-entry-id": deleted.encode(),
    }


def test_no_gap_when_everything_is_accounted_for() -> None:
    # 10 archived and trimmed by us, 5 in the stream after the checkpoint
    assert find_gap(info("11-0", 5, 15), EntryId(10, 0), accounted=10, buffered=0) is None
    # nothing archived yet, nothing trimmed
    assert find_gap(info("1-0", 15, 15), None, accounted=0, buffered=0) is None
    # buffered entries (read, not archived) trimmed meanwhile are not lost
    assert find_gap(info("16-0", 0, 15), EntryId(15, 0), accounted=10, buffered=5) is None


def test_gap_when_trimmed_before_archiving() -> None:
    # checkpoint 10-0 (10 archived); 20 more added, 12 trimmed unread: first entry 23-0
    found = find_gap(info("23-0", 8, 30), EntryId(10, 0), accounted=10, buffered=0)
    assert found == (EntryId(10, 0), EntryId(23, 0), 12, found[3])  # type: ignore[index]
    # the whole stream trimmed: "before" is just after the last generated ID
    found = find_gap(info(None, 0, 30, last="30-0"), EntryId(10, 0), accounted=10, buffered=0)
    assert found is not None and found[1] == EntryId(30, 1) and found[2] == 20


def test_gap_from_xdel_has_unknown_count() -> None:
    found = find_gap(info("1-0", 14, 15, deleted="12-0"), EntryId(10, 0), accounted=10, buffered=0)
    assert found is not None and found[:3] == (EntryId(10, 0), EntryId(12, 1), None)


# -- stores -------------------------------------------------------------------------------------
def test_open_store_schemes(tmp_path) -> None:
    import anyio
    import obstore
    from obstore.store import LocalStore, MemoryStore, S3Store

    from eventbus.tier.errors import StoreError
    from eventbus.tier.store import list_segments, open_store, put_create

    assert isinstance(open_store("memory://"), MemoryStore)
    local = open_store(str(tmp_path / "a" / "b"))
    assert isinstance(local, LocalStore) and (tmp_path / "a" / "b").is_dir()
    assert isinstance(open_store(f"file://{tmp_path}/c"), LocalStore)
    s3 = open_store("s3://bucket/pre/fix", endpoint="http://127.0.0.1:9", region="eu-west-1")
    assert isinstance(s3, S3Store) and s3.prefix == "pre/fix"
    assert str((s3.client_options or {}).get("allow_http")).lower() == "true"
    assert s3.config.get("endpoint") == "http://127.0.0.1:9"
    with pytest.raises(StoreError, match="nope://x"):
        open_store("nope://x")

    async def create_only() -> None:
        store = open_store("memory://")
        key = segment_key("t", 0, EntryId(1, 0), EntryId(2, 0))
        assert await put_create(store, key, b"first")
        assert not await put_create(store, key, b"second")  # never overwritten
        assert bytes((await obstore.get_async(store, key)).bytes()) == b"first"
        later = segment_key("t", 0, EntryId(3, 0), EntryId(4, 0))
        await put_create(store, later, b"x")
        await put_create(store, gap_key("t", 0, EntryId(2, 0), EntryId(3, 0)), b"{}")
        refs = await list_segments(store, "t", 0)
        assert [r.key for r in refs] == [key, later]  # gap records are not segments
        assert [r.key for r in await list_segments(store, "t", 0, after=refs[0])] == [later]

    anyio.run(create_only)


def test_listings_cover_both_layouts_once_per_range() -> None:
    """A store holding segments and gap records of the earlier layout (``t/0/``,
    ``t/0/gaps/``) and of the Hive-style one (``t/shard=0/``, ``t/shard=0/_gaps/``): shards,
    segments (in entry-ID order, after a given one too) and gap records are listed from both,
    a range stored in both folders once (the Hive-style folder's)."""
    import anyio

    from eventbus.tier.gaps import gap_records
    from eventbus.tier.store import (
        list_segments,
        list_segments_sync,
        list_shards_sync,
        open_store,
        put_create,
    )

    def ids(a: int, b: int) -> tuple[EntryId, EntryId]:
        return EntryId(a, 0), EntryId(b, 0)

    def gap(a: int, b: int, shard: int) -> bytes:
        return (
            f'{{"topic": "t", "shard": {shard}, "after": "{a}-0", "before": "{b}-0", '
            '"lost_entries": 1, "detected_at_ms": 1, "detected_by": "x", "reason": "r"}'
        ).encode()

    def name(a: int, b: int) -> str:
        return segment_key("t", 0, *ids(a, b)).rsplit("/", 1)[1]

    async def fill() -> None:
        for key in (f"t/0/{name(1, 2)}", f"t/0/{name(5, 6)}", f"t/3/{name(1, 1)}"):
            await put_create(store, key, b"old")
        for a, b in ((3, 4), (5, 6), (7, 8)):
            await put_create(store, segment_key("t", 0, *ids(a, b)), b"new")
        await put_create(store, f"t/0/gaps/{name(2, 3)[:-8]}.json", gap(2, 3, 0))
        await put_create(store, gap_key("t", 0, *ids(4, 5)), gap(4, 5, 0))
        await put_create(store, "t/_dictionaries/1.zdict", b"d")

    store = open_store("memory://")
    anyio.run(fill)
    assert list_shards_sync(store, "t") == [0, 3]
    refs = list_segments_sync(store, "t", 0)
    assert [(r.first.ms, r.last.ms) for r in refs] == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert refs[2].key.startswith("t/shard=0/")  # the range in both folders: listed once
    after = anyio.run(lambda: list_segments(store, "t", 0, after=refs[1]))
    assert [(r.first.ms, r.last.ms) for r in after] == [(5, 6), (7, 8)]
    assert [r.shard for r in list_segments_sync(store, "t", 3)] == [3]
    assert [(g["after"], g["before"]) for g in gap_records(store, "t", 0)] == [
        ("2-0", "3-0"),
        ("4-0", "5-0"),
    ]
