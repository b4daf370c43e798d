"""Pruning from pushed filters (no SparkSession: the filter objects Spark hands over)."""

from __future__ import annotations

import datetime as dt

from pyspark.sql.datasource import EqualTo, GreaterThan, In, LessThan, LessThanOrEqual, Not

from eventbus.protocol.ids import EntryId
from eventbus.protocol.sharding import shard_of
from eventbus.spark.pruning import Pruning


def test_shards_resources_and_ids() -> None:
    p = Pruning.from_filters(
        [
            In(("shard",), (1, 2, 3)),
            EqualTo(("resource_id",), "r-9"),
            GreaterThan(("entry_ms",), 100),
            LessThanOrEqual(("entry_ms",), 200),
            Not(EqualTo(("shard",), 2)),  # not used for pruning: left to Spark
        ]
    )
    assert p.shards == frozenset({1, 2, 3})
    assert p.shard_set(4) == frozenset({1, 2, 3}) & {shard_of("r-9", 4)}
    assert p.shard_set(None) == frozenset({1, 2, 3})
    assert p.lo == EntryId(101, 0) and p.hi.ms == 200
    one = Pruning.from_filters([EqualTo(("entry_id",), "7-3"), EqualTo(("entry_id",), "bad")])
    assert one.lo == one.hi == EntryId(7, 3)


def test_published_at_bounds_are_conservative() -> None:
    t = dt.datetime(2026, 1, 1, 0, 0, 0, 500, tzinfo=dt.UTC)  # 0.5 ms past a whole ms
    ms = int(dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp()) * 1000
    below = Pruning.from_filters([LessThan(("published_at",), t)])
    assert below.time_hi == ms + 1  # a row at `ms` (= t - 0.5 ms) must not be pruned away
    above = Pruning.from_filters([GreaterThan(("published_at",), t)])
    assert above.time_lo == ms
