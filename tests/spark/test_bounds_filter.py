"""`eventbus.spark.bounds.bounds_filter` evaluated by Spark: a bounded native read's row filter
keeps exactly the rows within each shard's bounds, whether the entry IDs compare as one packed
``bigint`` or as (``entry_ms``, ``entry_seq``) pairs (sequence numbers of 2**20 and more)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from eventbus.protocol.ids import EntryId
from eventbus.spark.bounds import bounds_filter
from eventbus.spark.planning import SegmentsPart
from eventbus.tier.layout import SegmentRef

pytestmark = pytest.mark.integration

BIG = (1 << 20) - 1  # a sequence number at the packed key's cap, and beyond it below


def _rows(seqs: list[int]) -> list[tuple[str, int, int, int]]:
    """(topic, shard, entry_ms, entry_seq) rows of 3 shards, ms 99..102, the given seqs."""
    return [("t", s, ms, seq) for s, ms, seq in itertools.product(range(3), range(99, 103), seqs)]


def _kept(spark: Any, rows: list[Any], bounds: dict[int, tuple[EntryId, EntryId]]) -> set[Any]:
    bounded = []
    for s in range(3):
        ref = SegmentRef(EntryId(99, 0), EntryId(102, BIG + 9), f"t/{s}/x.parquet", 1, "t", s)
        lo, hi = bounds.get(s, (EntryId(0, 0), EntryId(1 << 64, 0)))
        bounded.append((ref, SegmentsPart((ref,), lo, hi)))
    cond = bounds_filter(bounded)
    assert cond is not None
    df = spark.createDataFrame(rows, "topic string, shard int, entry_ms bigint, entry_seq bigint")
    return {tuple(r) for r in df.where(cond).collect()}


def _expected(rows: list[Any], bounds: dict[int, tuple[EntryId, EntryId]]) -> set[Any]:
    out = set()
    for row in rows:
        lo, hi = bounds.get(row[1], (EntryId(0, 0), EntryId(1 << 64, 0)))
        if lo <= EntryId(row[2], row[3]) <= hi:
            out.add(tuple(row))
    return out


@pytest.mark.parametrize(
    "bounds",
    [
        # packed: bounds' seqs below the cap; rows' seqs at it and beyond sort after them
        {0: (EntryId(100, 1), EntryId(101, 2)), 2: (EntryId(99, 0), EntryId(100, 0))},
        {1: (EntryId(100, 5), EntryId(1 << 64, 0))},  # a start only
        # not packed: a bound's seq at the cap
        {0: (EntryId(100, BIG), EntryId(101, BIG + 3)), 1: (EntryId(101, 0), EntryId(101, 1))},
    ],
)
def test_the_filter_keeps_exactly_the_rows_within_each_shards_bounds(
    spark: Any, bounds: dict[int, tuple[EntryId, EntryId]]
) -> None:
    rows = _rows([0, 1, 2, 5, BIG - 1, BIG, BIG + 3, BIG + 4, 1 << 40])
    got = _kept(spark, rows, bounds)
    assert got == _expected(rows, bounds)
    assert got and len(got) < len(rows)
