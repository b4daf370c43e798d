"""Catch-up's reading ahead (`eventbus.tier.catchup_read.read_ahead`): a shard's segments come
as their batches in entry-ID order, each segment's end marked after its batches, the rows as
`read_segment` reads them; a corrupt segment raises `CorruptSegment` after the batches of the
segments before it, unwrapped; leaving the block early stops the reading and lets the block's
own error through unwrapped. Segments are written with the offloader's encoder into a memory
store (`test_tier_replay.put`)."""

from __future__ import annotations

import obstore
import pytest
from test_tier_replay import TOPIC, put

from eventbus.protocol.ids import EntryId
from eventbus.tier import replay
from eventbus.tier.archived import ReplayFilter, read_segment
from eventbus.tier.catchup_read import ReadBatch, read_ahead
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.layout import SegmentRef
from eventbus.tier.store import Store, list_segments_sync, open_store

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 3 entries: a segment is read in several."""
    monkeypatch.setattr(replay, "BATCH_ROWS", 3)


def shard_of_three_segments(store: Store) -> list[SegmentRef]:
    put(store, 0, [EntryId(10, i) for i in range(7)])
    put(store, 0, [EntryId(20, i) for i in range(2)])
    put(store, 0, [EntryId(30, i) for i in range(5)])
    return list_segments_sync(store, TOPIC, 0)


async def read_all(
    store: Store, refs: list[SegmentRef], flt: ReplayFilter, *, entries: bool
) -> list[ReadBatch]:
    async with read_ahead(store, refs, flt, entries=entries, depth=2) as batches:
        return [b async for b in batches]


@pytest.mark.parametrize("entries", [True, False])
async def test_segments_come_as_their_batches_in_order_each_end_marked(entries: bool) -> None:
    store = open_store("memory://")
    refs = shard_of_three_segments(store)
    flt = ReplayFilter(start_id=EntryId(10, 2))
    got = await read_all(store, refs, flt, entries=entries)
    ends = [b.ref for b in got if b.rows is None]
    assert ends == refs
    for ref in refs:  # each segment's batches come before its end, as it reads
        mine = [b for b in got if b.ref == ref]
        assert mine[-1].rows is None
        want = read_segment(store, ref, flt).entries
        assert all(b.rows.n <= 3 for b in mine[:-1])  # type: ignore[union-attr]
        if entries:
            assert [e for b in mine[:-1] for e in b.entries or []] == want
        else:
            assert all(b.entries is None for b in mine)
            ids = [i for b in mine[:-1] for i in b.rows.stream_entries()[0]]  # type: ignore[union-attr]
            assert ids == [str(e.entry_id).encode() for e in want]
            fields = [f for b in mine[:-1] for f in b.rows.stream_entries()[1]]  # type: ignore[union-attr]
            assert fields == [e.fields() for e in want]


async def test_a_corrupt_segment_raises_after_the_batches_before_it_unwrapped() -> None:
    store = open_store("memory://")
    refs = shard_of_three_segments(store)
    obstore.put(store, refs[1].key, b"PAR1 not a segment")
    seen: list[ReadBatch] = []
    with pytest.raises(CorruptSegment, match=refs[1].key):
        async with read_ahead(store, refs, ReplayFilter(), entries=True) as batches:
            async for b in batches:
                seen.append(b)
    assert {b.ref for b in seen} == {refs[0]}
    assert [b.rows is None for b in seen][-1]  # the first segment was given to its end


async def test_leaving_early_stops_the_reading_and_keeps_the_blocks_error() -> None:
    store = open_store("memory://")
    refs = shard_of_three_segments(store)

    class Stop(Exception):
        pass

    with pytest.raises(Stop):
        async with read_ahead(store, refs, ReplayFilter(), entries=False) as batches:
            async for _ in batches:
                raise Stop
    async with read_ahead(store, refs, ReplayFilter(), entries=False) as batches:
        async for _ in batches:
            break  # leaving without an error: the reading task ends with the block
