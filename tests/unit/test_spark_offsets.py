"""Offsets keyed by topic then shard: ``startingOffsets`` of a read of several topics, a
checkpoint's offsets checked against the read's topic set, and ``maxOffsetsPerTrigger`` split over
(topic, shard) pairs in proportion to their lag."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyspark")

from eventbus.errors import ConfigError
from eventbus.spark.offsets import by_topic, parse_start, share

TWO = ("orders", "payments")


def test_a_json_offset_of_several_topics_is_keyed_by_topic_and_names_each() -> None:
    text = '{"orders": {"0": "17-0"}, "payments": {"2": "18-1"}}'
    assert parse_start(text, "orders", TWO) == {"0": "17-0"}
    assert parse_start(text, "payments", TWO) == {"2": "18-1"}
    with pytest.raises(ConfigError, match=r"startingOffsets.*names topics \['orders'\], not 'pay"):
        parse_start('{"orders": {"0": "17-0"}}', "payments", TWO)
    with pytest.raises(
        ConfigError, match=r"names topics \['refunds'\] the read does not subscribe"
    ):
        parse_start('{"orders": {}, "payments": {}, "refunds": {"0": "1-0"}}', "orders", TWO)
    with pytest.raises(ConfigError, match=r"endingOffsets.*several topics .* keyed by topic"):
        parse_start('{"0": "17-0"}', "orders", TWO, name="endingOffsets")
    with pytest.raises(ConfigError, match="startingOffsets: bad JSON offset"):
        parse_start("{[1]}", "orders", TWO)


def test_one_topic_keeps_its_shard_keyed_offsets_and_refuses_other_topics() -> None:
    assert parse_start('{"0": "17-0"}', "orders") == {"0": "17-0"}
    assert parse_start('{"orders": {"1": "17-0"}}', "orders", ("orders",)) == {"1": "17-0"}
    with pytest.raises(ConfigError, match=r"\['typo'\] the read does not subscribe"):
        parse_start('{"orders": {"1": "17-0"}, "typo": {}}', "orders")
    assert parse_start("latest", "orders", TWO) == "latest"
    assert parse_start("1700000000000", "payments", TWO) == 1700000000000


def test_a_checkpoint_is_read_for_the_same_topic_set_only() -> None:
    offset = {"payments": {"0": "5-0"}, "orders": {"0": "7-1", "1": "8-0"}}
    assert by_topic(offset, TWO) == {"orders": {"0": "7-1", "1": "8-0"}, "payments": {"0": "5-0"}}
    for topics in (("orders",), ("orders", "refunds"), (*TWO, "refunds")):
        with pytest.raises(ConfigError, match="checkpoint holds offsets of topic"):
            by_topic(offset, topics)
    # written before offsets were keyed by topic: one topic's, per shard
    assert by_topic({"0": "7-1"}, ("orders",)) == {"orders": {"0": "7-1"}}
    with pytest.raises(ConfigError, match=r"offsets of one topic .* use a new checkpointLocation"):
        by_topic({"0": "7-1"}, TWO)
    assert by_topic({}, TWO) == {"orders": {}, "payments": {}}


@pytest.mark.parametrize(
    "lags",
    [[400, 12, 12, 12], [1000, 1000], [5, 5, 5, 5, 5, 5, 5, 5], [1, 10_000], [3, 0, 7], [60] * 3],
)
@pytest.mark.parametrize("total", [1, 3, 4, 48, 100, 10_000])
def test_the_per_trigger_limit_is_split_in_proportion_to_the_lag(
    total: int, lags: list[int]
) -> None:
    """Never more than the limit, nor more than a pair's lag; all of the limit while entries
    wait; each pair at least one when the limit allows (as Kafka's source, which does not
    starve small partitions), the rest within one entry of its share by lag."""
    quotas = share(total, lags)
    waiting = [max(1, lag) for lag in lags]
    assert len(quotas) == len(lags) and sum(quotas) == min(total, sum(waiting))
    assert all(0 <= q <= w for q, w in zip(quotas, waiting, strict=True))
    if total >= len(lags):
        assert min(quotas) >= 1
        if sum(waiting) > total:  # one each, the rest prorated by the lag beyond that one
            rest, whole = total - len(lags), sum(waiting) - len(lags)
            for q, w in zip(quotas, waiting, strict=True):
                assert abs(q - 1 - rest * (w - 1) / whole) < 1
    else:  # the first `total` pairs (least advanced first) get one
        assert quotas == [1] * total + [0] * (len(lags) - total)


def test_a_shard_far_behind_gets_the_most_of_the_limit() -> None:
    """It was split evenly: 25 entries for a shard 400 behind and 25 for each 12 behind, so a
    micro-batch of limit 100 read 61 entries (and emptied the shards nearly caught up)."""
    assert share(100, [400, 12, 12, 12]) == [90, 4, 3, 3]
    assert share(100, [10, 10, 10, 10]) == [10, 10, 10, 10]  # all that waits, under the limit
    assert share(0, [5, 5]) == [0, 0] and share(10, []) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        share(-1, [5])


def test_a_stream_refuses_ending_offsets() -> None:
    """Kafka's source refuses endingOffsets in a stream; it was ignored here (the stream read
    past the given end)."""
    from eventbus.spark.schema import read_schema
    from eventbus.spark.source import EventbusSource

    source = EventbusSource({"store": "memory://", "topic": "orders", "endingOffsets": "{}"})
    reader = source.streamReader(read_schema(None))  # raising here, PySpark hid the error
    with pytest.raises(ConfigError, match="endingOffsets is for batch reads"):
        reader.initialOffset()
    source = EventbusSource({"store": "memory://", "subscribe": "orders,payments"})
    assert source.streamReader(read_schema(None)).topics == TWO  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["23", 23, "-1", "-2", -1, "1700000000000"])
def test_kafka_numeric_offsets_are_refused_asking_for_entry_ids(value: object) -> None:
    """Kafka's JSON offsets are numbers (``-1`` latest, ``-2`` earliest); a bare number here
    was taken as the entry ID of that millisecond (all rows, or none)."""
    for text in (json.dumps({"orders": {"0": value}}), json.dumps({"0": value})):
        with pytest.raises(ConfigError, match=r"not an entry ID.*\"<ms>-<seq>\" text"):
            parse_start(text, "orders", name="endingOffsets")


def test_batch_offsets_of_an_unknown_shard_or_ending_before_the_start_are_refused() -> None:
    from eventbus.protocol.ids import EntryId
    from eventbus.spark.planning import check_bounds

    a, b = EntryId(5, 0), EntryId(9, 0)
    check_bounds("orders", {0, 1}, {0: a}, {0: b, 1: b})
    with pytest.raises(ConfigError, match=r"topic 'orders' has no shard 7 \(its shards: 0, 1\)"):
        check_bounds("orders", {0, 1}, {7: a}, {})
    with pytest.raises(ConfigError, match="shard 1 ends at 5-0, before it starts after 9-0"):
        check_bounds("orders", {0, 1}, {1: b}, {1: a})
