"""One segment reader (`eventbus.tier.segment_read.decode_segment`) for replay and the Spark source:
a damaged segment is refused by both with the same `CorruptSegment`, naming the object key and
the first entry at fault; the order check over whole columns gives the verdict of the entry-by-
entry reading (the spec below, `_first_fault`) on every order of entry IDs."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
from eventbus.protocol.ids import EntryId
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.layout import parse_segment_key, segment_key
from eventbus.tier.replay import iter_shard
from eventbus.tier.segment_read import decode_segment, decode_segment_batches
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import open_store

TOPIC = "orders"


def _entry(entry_id: EntryId, i: int) -> tuple[EntryId, dict[bytes, bytes]]:
    env = Envelope(f"r{i % 5}", "Tick", new_event_id(), 1_700_000_000_000 + i, {}, {"i": i})
    return entry_id, encode_entry(env)


def _forge(
    ids: list[EntryId], first: EntryId, last: EntryId, shard: int = 0, meta_shard: int | None = None
) -> bytes:
    """A segment of entries `ids` in the order given (the offloader refuses to write one out of
    order), whose metadata names `first`..`last` and shard `meta_shard` (default `shard`)."""
    unique = sorted(set(ids))
    entries = [_entry(i, n) for n, i in enumerate(unique)]
    data, _ = encode_segment(TOPIC, shard, unique[0], unique[-1], entries)
    table = pq.read_table(io.BytesIO(data)).take(pa.array([unique.index(i) for i in ids]))
    meta = dict(table.schema.metadata)
    meta[b"eventbus.first"], meta[b"eventbus.last"] = str(first).encode(), str(last).encode()
    meta[b"eventbus.shard"] = str(shard if meta_shard is None else meta_shard).encode()
    meta[b"eventbus.entries"] = str(len(ids)).encode()
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(meta), sink, write_page_checksum=True)
    return sink.getvalue()


def _first_fault(ids: list[EntryId], first: EntryId, last: EntryId) -> EntryId | None:
    """The spec: the first entry not after the one before it (the first entry: not at or after
    `first`) or after `last`, reading entry by entry."""
    prev = first.prev() if first > EntryId(0, 0) else None
    for current in ids:
        if (prev is not None and current <= prev) or current > last:
            return current
        prev = current
    return None


def _ids(rng: random.Random) -> list[EntryId]:
    n = rng.randrange(1, 12)
    ids = sorted({EntryId(rng.randrange(5, 9), rng.randrange(0, 4)) for _ in range(n)})
    kind = rng.choice(["ordered", "swap", "duplicate", "shuffle"])
    if kind == "swap" and len(ids) > 1:
        a, b = rng.sample(range(len(ids)), 2)
        ids[a], ids[b] = ids[b], ids[a]
    elif kind == "duplicate":
        i = rng.randrange(len(ids))
        ids.insert(i, ids[i])
    elif kind == "shuffle":
        rng.shuffle(ids)
    return ids


def test_the_order_check_gives_the_entry_by_entry_verdict() -> None:
    """300 seeded cases of ordered, swapped, repeated and shuffled entry IDs, against ranges
    that hold them all, cut off their first or last ones, or start at 0-0."""
    rng = random.Random(21)
    for _ in range(300):
        ids = _ids(rng)
        lo, hi = min(ids), max(ids)
        first = rng.choice([lo, EntryId(0, 0), EntryId(lo.ms, lo.seq + 1), EntryId(4, 0)])
        last = rng.choice([hi, EntryId(hi.ms, hi.seq - 1) if hi.seq else hi, EntryId(9, 0)])
        want = _first_fault(ids, first, last)
        data = _forge(ids, first, last)
        if want is None:
            table, _ = decode_segment(data, "k")
            got = [
                EntryId(*p)
                for p in zip(
                    *table.select(["entry_ms", "entry_seq"]).to_pydict().values(), strict=True
                )
            ]
            assert got == ids
        else:
            with pytest.raises(CorruptSegment, match=f"entry {want} out of order or outside"):
                decode_segment(data, "k")


def test_reading_by_batches_gives_the_entry_by_entry_verdict_across_batch_edges() -> None:
    """The same 300 seeded cases read by `decode_segment_batches` in batches of 1 to 3 rows: a
    fault where one batch ends and the next begins is found, the rows before it come whole."""
    rng = random.Random(21)
    for _ in range(300):
        ids = _ids(rng)
        lo, hi = min(ids), max(ids)
        first = rng.choice([lo, EntryId(0, 0), EntryId(lo.ms, lo.seq + 1), EntryId(4, 0)])
        last = rng.choice([hi, EntryId(hi.ms, hi.seq - 1) if hi.seq else hi, EntryId(9, 0)])
        want = _first_fault(ids, first, last)
        _, batches = decode_segment_batches(
            _forge(ids, first, last), "k", batch_rows=rng.randint(1, 3)
        )
        got: list[EntryId] = []
        if want is None:
            for table in batches:
                got += [
                    EntryId(m, s)
                    for m, s in zip(
                        *table.select(["entry_ms", "entry_seq"]).to_pydict().values(), strict=True
                    )
                ]
            assert got == ids
        else:
            with pytest.raises(CorruptSegment, match=f"entry {want} out of order or outside"):
                for table in batches:
                    got += table.column("entry_ms").to_pylist()
            bounds = [first.prev() if first > EntryId(0, 0) else None, *ids]
            fault = next(  # where the spec finds `want`
                i
                for i, (prev, current) in enumerate(zip(bounds, ids, strict=False))
                if (prev is not None and current <= prev) or current > last
            )
            assert len(got) <= fault and got == [i.ms for i in ids[: len(got)]]


def _both_readers(root: Path, data: bytes, first: EntryId, last: EntryId) -> tuple[str, str]:
    """The `CorruptSegment` text of replay and of the Spark source on segment `data` stored
    under the key `first`..`last` of shard 0."""
    pytest.importorskip("pyspark")
    from eventbus.spark.objects import Objects
    from eventbus.spark.reading import read_segments

    key = segment_key(TOPIC, 0, first, last)
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_bytes(data)
    store = open_store(str(root))
    with pytest.raises(CorruptSegment) as replayed:
        list(iter_shard(store, TOPIC, 0))
    ref = parse_segment_key(key, len(data))
    assert ref is not None
    with pytest.raises(CorruptSegment) as sparked:
        list(read_segments(Objects(store), [ref], None, None))
    return str(replayed.value), str(sparked.value)


@pytest.mark.parametrize("damage", ["swapped", "below_first", "past_last", "other_shard"])
def test_replay_and_spark_refuse_a_damaged_segment_alike(tmp_path: Path, damage: str) -> None:
    """The Spark source said only "entries out of order" (no entry) and "not what the key
    says" (not what it says); both now give the tier's text, naming the key and the entry."""
    ids = [EntryId(10, s) for s in range(6)]
    first, last = ids[0], ids[-1]
    shard = 0
    if damage == "swapped":
        ids[2], ids[3] = ids[3], ids[2]
        want = "entry 10-2 out of order or outside 10-0..10-5"
    elif damage == "below_first":
        first = EntryId(10, 1)
        want = "entry 10-0 out of order or outside 10-1..10-5"
    elif damage == "past_last":
        last = EntryId(10, 3)
        want = "entry 10-4 out of order or outside 10-0..10-3"
    else:
        shard = 1
        want = f"metadata says {TOPIC}/1 10-0..10-5, the key says {TOPIC}/0 10-0..10-5"
    data = _forge(ids, first, last, meta_shard=shard)
    replayed, sparked = _both_readers(tmp_path, data, first, last)
    assert replayed == sparked
    assert want in sparked and segment_key(TOPIC, 0, first, last) in sparked


def test_a_segment_is_parsed_from_memory_arrow_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow's worker threads release the buffers a Parquet read used after the read returned.
    Read through a Python object (an `io.BytesIO`), that release needs the GIL, which no thread
    can take once the interpreter exits: ``eventbus replay`` failing on a corrupt segment
    aborted with "terminate called without an active exception" (exit -6) in about 1 run of
    10. The segment is parsed from a copy Arrow owns (`pa.BufferReader`), never from `data`."""
    ids = [EntryId(10, s) for s in range(6)]
    data = _forge(ids, ids[0], ids[-1])
    sources: list[object] = []
    parquet_file = pq.ParquetFile

    def spy(source: object, **kwargs: object) -> pq.ParquetFile:
        sources.append(source)
        return parquet_file(source, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pq, "ParquetFile", spy)
    table, _ = decode_segment(data, segment_key(TOPIC, 0, ids[0], ids[-1]))
    assert table.num_rows == 6
    [source] = sources
    assert isinstance(source, pa.BufferReader), type(source)


def test_an_event_id_that_is_no_uuid_is_a_corrupt_segment(tmp_path: Path) -> None:
    """A segment whose ``event_id`` column holds text that is not a UUID (the offloader writes
    the envelope's, or null) raised ``ValueError`` from replay and catch-up, not the
    `CorruptSegment` naming the object that they handle (found by tests/unit/
    test_decoders_fuzz.py)."""
    ids = [EntryId(10, s) for s in range(3)]
    table = pq.read_table(io.BytesIO(_forge(ids, ids[0], ids[-1])))
    column = table.schema.get_field_index("event_id")
    table = table.set_column(column, "event_id", pa.array([None, "not-a-uuid", None], pa.string()))
    sink = io.BytesIO()
    pq.write_table(table, sink, write_page_checksum=True)
    key = segment_key(TOPIC, 0, ids[0], ids[-1])
    (tmp_path / key).parent.mkdir(parents=True)
    (tmp_path / key).write_bytes(sink.getvalue())
    with pytest.raises(CorruptSegment, match=r"event_id .*not a UUID"):
        list(iter_shard(open_store(str(tmp_path)), TOPIC, 0))
