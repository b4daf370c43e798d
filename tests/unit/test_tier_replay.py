"""Replay by batches (`eventbus.tier.replay`): the merge of shards by batch cursors gives one
entry-ID order (ties by shard index) whatever the batches' cuts, ranges cut batches where they
must, empty segments and filtered-out segments give nothing, overlapping segments each entry
once, a deleted segment is a gap, and typed replay reports the first bad entry after yielding
those before it. Segments are written with the offloader's own encoder into a memory store."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import obstore
import pyarrow as pa
import pytest
from pydantic import BaseModel

from eventbus.errors import DecodeError
from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.tier import replay
from eventbus.tier.archived import EntryBatch, ReplayFilter, read_segment
from eventbus.tier.completeness import check_complete
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.layout import segment_key
from eventbus.tier.merge import merge_batches
from eventbus.tier.replay import iter_events, iter_shard, iter_topic
from eventbus.tier.replay_events import decode_event, models_by_type
from eventbus.tier.segment import SCHEMA, entry_arrays
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import Store, open_store

TOPIC = "orders"


class Tick(BaseModel):
    seq: int


def fields(
    seq: object, rid: str = "r", headers: dict[str, str] | None = None
) -> dict[bytes, bytes]:
    env = Envelope(rid, "Tick", new_event_id(), 1_700_000_000_000, headers or {}, {"seq": seq})
    return encode_entry(env)


def put(store: Store, shard: int, ids: list[EntryId], seqs: list[object] | None = None) -> str:
    """One segment of `shard` holding entries `ids` (payload ``seq`` = `seqs`, default the
    position), its key's range the first and last ID; returns the key."""
    seqs = list(range(len(ids))) if seqs is None else seqs
    rows = [(i, fields(s, rid=f"r{k % 3}")) for k, (i, s) in enumerate(zip(ids, seqs, strict=True))]
    first, last = (ids[0], ids[-1]) if ids else (EntryId(1, 0), EntryId(1, 0))
    data, _ = encode_segment(TOPIC, shard, first, last, rows)
    key = segment_key(TOPIC, shard, first, last)
    obstore.put(store, key, data)
    return key


def ids_of(entries: object) -> list[tuple[EntryId, int]]:
    return [(e.entry_id, e.shard) for e in entries]  # type: ignore[attr-defined]


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 3 entries: many rounds of the merge, cuts inside segments."""
    monkeypatch.setattr(replay, "BATCH_ROWS", 3)


def interleaved(rng: random.Random, shards: int, n: int) -> dict[int, list[EntryId]]:
    """`n` entry IDs per shard on few milliseconds: equal ms with different seqs across and
    within shards, and some IDs equal in two shards."""
    out = {}
    for s in range(shards):
        ids = {EntryId(100 + rng.randrange(12), rng.randrange(4)) for _ in range(n)}
        out[s] = sorted(ids)
    return out


def test_interleaved_shards_merge_in_entry_id_order_ties_by_shard(small_batches: None) -> None:
    rng = random.Random(7)
    store = open_store("memory://")
    per_shard = interleaved(rng, 4, 30)
    for s, ids in per_shard.items():
        cut = len(ids) // 2  # two segments per shard
        put(store, s, ids[:cut])
        put(store, s, ids[cut:])
    expected = sorted((i, s) for s, ids in per_shard.items() for i in ids)
    assert len({i for i, _ in expected}) < len(expected)  # equal IDs in two shards exist
    assert ids_of(iter_topic(store, TOPIC)) == expected
    per = ids_of(iter_topic(store, TOPIC, merge=False))
    assert per == sorted(expected, key=lambda x: (x[1], x[0]))


def test_merge_batches_on_random_cuts_equals_a_sort() -> None:
    """Whatever the batch sizes, and with one shard entirely before the others (handed on whole)
    or one left alone at the end, and whatever the chunks its entries are made by, the merge
    gives the sorted order."""
    rng = random.Random(11)
    for _ in range(50):
        shards = rng.randrange(1, 6)
        streams: list[list[EntryId]] = []
        for _ in range(shards):
            base = rng.choice([0, 50, 1000])  # sometimes far ahead of the others
            streams.append(
                sorted({EntryId(base + rng.randrange(20), rng.randrange(3)) for _ in range(25)})
            )

        def batches(s: int, ids: list[EntryId]) -> Iterator[EntryBatch]:
            i = 0
            while i < len(ids):
                n = rng.randrange(1, 8)
                rows = [(x, fields(0)) for x in ids[i : i + n]]
                table = pa.Table.from_arrays(entry_arrays(TOPIC, s, rows), schema=SCHEMA)
                yield EntryBatch(table, TOPIC, s, f"seg-{s}")
                i += n

        merged = [
            e
            for b in merge_batches(
                [batches(s, ids) for s, ids in enumerate(streams)],
                chunk=rng.choice([None, 1, 2, 5]),
            )
            for e in b
        ]
        assert ids_of(merged) == sorted((i, s) for s, ids in enumerate(streams) for i in ids)


@pytest.mark.parametrize(
    "flt",
    [
        ReplayFilter(start_id=EntryId(103, 2), end_id=EntryId(108, 1)),
        ReplayFilter(start_id=EntryId(103, 7)),  # a seq no entry has: between entries
        ReplayFilter(end_id=EntryId(105, 0)),
        ReplayFilter(since_ms=104, until_ms=107),
        ReplayFilter(since_ms=104, resource_ids=frozenset({"r1"})),
        ReplayFilter(start_id=EntryId(200, 0)),  # after everything
        ReplayFilter(event_types=frozenset({"Other"})),  # nothing matches
    ],
)
def test_ranges_and_filters_cut_batches_where_they_must(
    small_batches: None, flt: ReplayFilter
) -> None:
    rng = random.Random(3)
    store = open_store("memory://")
    per_shard = interleaved(rng, 3, 40)
    rids = {}
    for s, ids in per_shard.items():
        put(store, s, ids)
        rids.update({(i, s): f"r{k % 3}" for k, i in enumerate(ids)})
    low, high = flt.lower, flt.upper
    expected = [
        (i, s)
        for i, s in sorted((i, s) for s, ids in per_shard.items() for i in ids)
        if low <= i <= high
        and (flt.resource_ids is None or rids[(i, s)] in flt.resource_ids)
        and (flt.event_types is None or "Tick" in flt.event_types)
    ]
    assert ids_of(iter_topic(store, TOPIC, flt)) == expected


def test_empty_segments_and_shards_without_matches_give_nothing(small_batches: None) -> None:
    store = open_store("memory://")
    put(store, 0, [])  # an empty segment
    put(store, 0, [EntryId(5, 0), EntryId(6, 0)])
    put(store, 1, [])
    put(store, 2, [EntryId(5, 0)])
    assert read_segment(store, replay.plan(store, TOPIC)[1][0]).entries == []
    assert ids_of(iter_topic(store, TOPIC)) == [
        (EntryId(5, 0), 0),
        (EntryId(5, 0), 2),
        (EntryId(6, 0), 0),
    ]
    counts: dict[int, int] = {}
    assert list(iter_topic(store, TOPIC, ReplayFilter(start_id=EntryId(7, 0)), counts=counts)) == []


def test_overlapping_segments_give_each_entry_once(small_batches: None) -> None:
    store = open_store("memory://")
    ids = [EntryId(10 + i, 0) for i in range(10)]
    put(store, 0, ids[:7])
    put(store, 0, ids[4:])  # entries 4..6 in both
    assert [e.entry_id for e in iter_shard(store, TOPIC, 0)] == ids
    assert [e.entry_id for e in iter_topic(store, TOPIC)] == ids


def test_a_deleted_segment_is_a_gap_against_the_checkpoint(small_batches: None) -> None:
    store = open_store("memory://")
    ids = [EntryId(10 + i, 0) for i in range(9)]
    put(store, 0, ids[:3])
    middle = put(store, 0, ids[3:6])
    put(store, 0, ids[6:])
    obstore.delete(store, middle)
    counts: dict[int, int] = {}
    got = [e.entry_id for e in iter_topic(store, TOPIC, counts=counts)]
    assert got == ids[:3] + ids[6:]
    (gap,) = check_complete(store, TOPIC, counts, {0: 9})
    assert (gap.shard, gap.accounted, gap.archived) == (0, 9, 6)


def test_entries_carry_every_column(small_batches: None) -> None:
    store = open_store("memory://")
    rows = [(EntryId(9, 1), fields(1, rid="plane", headers={"trace": "t1"}))]
    data, _ = encode_segment(TOPIC, 3, EntryId(9, 1), EntryId(9, 1), rows)
    key = segment_key(TOPIC, 3, EntryId(9, 1), EntryId(9, 1))
    obstore.put(store, key, data)
    (e,) = iter_topic(store, TOPIC)
    env = e.envelope()
    assert (e.topic, e.shard, e.entry_id, e.resource_id, e.event_type) == (
        TOPIC,
        3,
        EntryId(9, 1),
        "plane",
        "Tick",
    )
    assert e.headers == {"trace": "t1"} and e.event_id == env.event_id
    assert e.published_at_ms == env.published_at_ms and e.data == rows[0][1][b"data"]
    assert e.segment == key and e.fields() == rows[0][1]
    with pytest.raises(AttributeError):
        e.shard = 4  # type: ignore[misc]


def test_typed_replay_yields_the_entries_before_a_bad_one_then_names_it(
    small_batches: None,
) -> None:
    store = open_store("memory://")
    ids = [EntryId(10 + i, 0) for i in range(8)]
    key = put(store, 0, ids, seqs=[0, 1, 2, 3, "four", 5, 6, 7])
    got = []
    with pytest.raises(DecodeError, match=f"{key} entry 14-0: payload does not validate as Tick"):
        for ev in iter_events(store, TOPIC, [Tick]):
            got.append(ev.event.seq)  # type: ignore[attr-defined]
    assert got == [0, 1, 2, 3]
    put(store, 1, [EntryId(30, 0)])
    events = list(iter_events(store, TOPIC, [Tick], ReplayFilter(start_id=EntryId(15, 0))))
    assert [(e.entry.entry_id, e.event) for e in events] == [
        (EntryId(15, 0), Tick(seq=5)),
        (EntryId(16, 0), Tick(seq=6)),
        (EntryId(17, 0), Tick(seq=7)),
        (EntryId(30, 0), Tick(seq=0)),
    ]
    assert events[0].envelope == events[0].entry.envelope()


def test_a_segment_whose_event_id_is_no_uuid_is_corrupt() -> None:
    store = open_store("memory://")
    key = put(store, 0, [EntryId(5, 0)])
    import io

    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(bytes(obstore.get(store, key).bytes())))
    bad = table.set_column(8, "event_id", pa.array(["not-a-uuid"], pa.string()))
    sink = io.BytesIO()
    pq.write_table(bad, sink, write_page_checksum=True)
    obstore.put(store, key, sink.getvalue())
    with pytest.raises(CorruptSegment, match="event_id"):
        list(iter_topic(store, TOPIC))
    rows = bad.combine_chunks()
    with pytest.raises(CorruptSegment, match="event_id"):  # what typed catch-up reads
        EntryBatch(rows, TOPIC, 0, key).stream_entries()
    braces = rows.set_column(8, "event_id", pa.array(["{" + str(uuid.uuid4()) + "}"]))
    assert len(EntryBatch(braces, TOPIC, 0, key).stream_entries()[0]) == 1  # as uuid.UUID takes


def test_typed_replay_decodes_a_batch_as_each_entry_decodes_and_names_a_corrupt_envelope() -> None:
    """Envelopes decoded for a whole batch at once equal `ArchivedEntry.envelope`'s; a batch
    holding an envelope that does not decode yields the entries before it, then its error."""
    store = open_store("memory://")
    ids = [EntryId(50 + i, 0) for i in range(6)]
    rows = [
        (i, fields(k, rid=f"r{k}", headers={"h": str(k)} if k % 2 else None))
        for k, i in enumerate(ids)
    ]
    rows[4] = (ids[4], {**rows[4][1], b"data": b"\x01\xc1"})  # 0xc1: never used in MessagePack
    data, _ = encode_segment(TOPIC, 0, ids[0], ids[-1], rows)
    key = segment_key(TOPIC, 0, ids[0], ids[-1])
    obstore.put(store, key, data)
    got = []
    with pytest.raises(DecodeError, match=f"{key} entry 54-0: corrupt envelope"):
        for ev in iter_events(store, TOPIC, [Tick]):
            got.append(ev)
    assert [ev.event for ev in got] == [Tick(seq=k) for k in range(4)]
    assert all(ev.envelope == ev.entry.envelope() for ev in got)
    # without the corrupt entry, the whole batch goes through the one-pass decode
    clean = open_store("memory://")
    good = [rows[k] for k in (0, 1, 2, 3, 5)]
    obstore.put(clean, key, encode_segment(TOPIC, 0, ids[0], ids[-1], good)[0])
    events = list(iter_events(clean, TOPIC, [Tick]))
    assert [ev.event for ev in events] == [Tick(seq=k) for k in (0, 1, 2, 3, 5)]
    assert all(ev.envelope == ev.entry.envelope() for ev in events)
    assert [ev.envelope.headers for ev in events][:2] == [{}, {"h": "1"}]
    assert events == [decode_event(ev.entry, models_by_type([Tick])) for ev in events]


def test_stream_entries_are_each_entry_id_and_fields_as_the_stream_held_them() -> None:
    """What catch-up hands the handling path: each row's ID and field map, the same as its
    `ArchivedEntry` gives, entries without a resource ID or type (not decoded) included."""
    ids = [EntryId(5, 0), EntryId(5, 1), EntryId(1_700_000_000_123, 42), EntryId(1 << 40, 7)]
    rows = [
        (ids[0], fields(1)),
        (ids[1], {b"data": b"\x00not an envelope"}),  # no rid, no type
        (ids[2], fields(3, rid="é-unicode", headers={"h": "v"})),
        (ids[3], {b"data": b"raw", b"type": b"T"}),  # a type, no rid
    ]
    table = pa.Table.from_arrays(entry_arrays(TOPIC, 2, rows), schema=SCHEMA)
    for batch in (EntryBatch(table, TOPIC, 2, "seg"), EntryBatch(table.slice(0, 0), TOPIC, 2, "s")):
        entries = batch.entries()
        assert batch.stream_entries() == (
            [str(e.entry_id).encode() for e in entries],
            [e.fields() for e in entries],
        )
    assert EntryBatch(table, TOPIC, 2, "seg").stream_entries()[0][2] == b"1700000000123-42"
    nulls = EntryBatch(table, TOPIC, 2, "seg").stream_entries()[1]
    assert nulls[1] == {b"data": b"\x00not an envelope"}
    assert nulls[3] == {b"data": b"raw", b"type": b"T"}
