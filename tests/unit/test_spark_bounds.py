"""`eventbus.spark.bounds.bounds_filter`: the row filter of a bounded native read."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from eventbus.protocol.ids import EntryId
from eventbus.spark.bounds import bounds_filter
from eventbus.spark.planning import SegmentsPart
from eventbus.tier.layout import SegmentRef


def straddling(topic: str, shards: int) -> list[tuple[SegmentRef, SegmentsPart]]:
    """One segment per shard, entries 1000-0 .. 2000-0, each bounded inside it."""
    out = []
    for s in range(shards):
        ref = SegmentRef(EntryId(1000, 0), EntryId(2000, 0), f"{topic}/{s}/x.parquet", 1, topic, s)
        out.append((ref, SegmentsPart((ref,), EntryId(1200 + s, 1), EntryId(1800 - s, 2))))
    return out


def test_the_filter_compares_entry_ids_a_fixed_number_of_times_however_many_shards() -> None:
    """A comparison per shard made the filter of 16 shards cost the JVM more than the read
    itself (``bounded_native`` at 0.09 x the whole read's rate): the bounds are array literals
    indexed by ``shard``, one packed key for 4 shards as for 256 (and the time range)."""
    few, many = bounds_filter(straddling("t", 4)), bounds_filter(straddling("t", 256))
    assert few is not None and many is not None
    assert few.count("entry_ms") == many.count("entry_ms") == 3
    assert f"{(1455 << 20) + 1}L" in many and f"{(1545 << 20) + 2}L" in many  # shard 255's


def test_bounds_with_a_large_sequence_number_compare_ms_and_seq_apart() -> None:
    """A bound whose ``entry_seq`` reaches 2**20 - 1 does not fit the packed key: the four
    parts are compared, still a fixed number of times."""
    bounded = straddling("t", 4)
    ref, part = bounded[0]
    bounded[0] = (ref, SegmentsPart((ref,), EntryId(1200, (1 << 20) - 1), part.hi))
    got = bounds_filter(bounded)
    assert got is not None and got.count("entry_ms") == 6 and "entry_seq >=" in got


def test_segments_inside_their_bounds_need_no_filter_and_topics_get_their_own() -> None:
    inside = [
        (r, SegmentsPart((r,), EntryId(0, 1), EntryId(9000, 0))) for r, _ in straddling("t", 3)
    ]
    assert bounds_filter(inside) is None
    both = bounds_filter([*straddling("a", 2), *inside])
    assert both is not None
    assert " AND (CASE topic WHEN 'a' THEN" in both and "'t'" not in both
    assert both.count("entry_ms") == 3


def test_the_filter_starts_with_the_time_range_of_the_rows_kept() -> None:
    """Plain ``entry_ms`` comparisons first (Spark pushes them to its Parquet reader): from the
    earliest kept row (a part's start inside its segment, or a segment's first entry when its
    part starts before it) to the latest one (likewise), whatever the shard."""
    bounded = straddling("t", 4)  # kept: 1200-1 .. 1800-2 in shard 0, 1203-1 .. 1797-2 in 3
    got = bounds_filter(bounded)
    assert got is not None and got.startswith("entry_ms >= 1200L AND entry_ms <= 1800L AND (")
    late = SegmentRef(EntryId(2500, 0), EntryId(2600, 0), "t/9/y.parquet", 1, "t", 9)
    whole = (late, SegmentsPart((late,), EntryId(0, 1), EntryId(9000, 0)))  # kept whole
    got = bounds_filter([*bounded, whole])
    assert got is not None and got.startswith("entry_ms >= 1200L AND entry_ms <= 2600L AND (")
