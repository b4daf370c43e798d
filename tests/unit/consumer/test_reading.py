"""`reading.strays`: which shards of a read round have entries pending for another consumer
(fenced delivery), from the round's XPENDING summaries, raw or parsed by redis-py; `Streaks`:
which summaries go with a read, ahead of its reply."""

from __future__ import annotations

from eventbus.consumer.read_summaries import AHEAD_AFTER, Streaks
from eventbus.consumer.reading import strays

ME = b"me-1"
NOTHING = [0, None, None, None]


def test_summaries_with_nothing_pending_or_only_mine_name_no_one() -> None:
    mine = [2, b"1-1", b"1-2", [[ME, b"2"]]]
    assert strays([NOTHING, mine, NOTHING], ME) == {}


def test_other_consumers_with_entries_pending_are_named_by_shard_index() -> None:
    stale = [1, b"1-1", b"1-1", [[b"stale", b"1"]]]
    mixed = [3, b"1-1", b"1-3", [[b"old", b"1"], [ME, b"1"], [b"stale", b"1"]]]
    assert strays([NOTHING, stale, NOTHING, mixed], ME) == {
        1: [b"stale"],
        3: [b"old", b"stale"],
    }


def test_summaries_parsed_by_redis_py_count_the_same() -> None:
    """On a Cluster or fakeredis the summaries come parsed, as redis-py's client returns them."""
    parsed = {
        "pending": 2,
        "min": b"1-1",
        "max": b"1-2",
        "consumers": [{"name": ME, "pending": 1}, {"name": b"stale", "pending": 1}],
    }
    empty = {"pending": 0, "min": None, "max": None, "consumers": []}
    assert strays([empty, parsed], ME) == {1: [b"stale"]}


STREAMS = ["s0", "s1", "s2"]


def test_a_stream_that_gave_entries_to_fewer_reads_in_a_row_is_summarized_after_its_read() -> None:
    """A trickle: entries now and then, several at once or not, sends no summary ahead."""
    streaks = Streaks()
    for _ in range(AHEAD_AFTER - 1):
        streaks.update(STREAMS, {"s1"})
        assert streaks.ahead(STREAMS) == []
    streaks.update(STREAMS, set())  # a read without entries of s1 ends its run
    streaks.update(STREAMS, {"s1"})
    assert streaks.ahead(STREAMS) == []


def test_a_stream_that_gave_entries_to_every_recent_read_is_summarized_with_the_next() -> None:
    streaks = Streaks()
    for _ in range(AHEAD_AFTER):
        streaks.update(STREAMS, {"s0", "s2"})
    assert streaks.ahead(STREAMS) == [0, 2]
    assert streaks.ahead(["s2"]) == [0]  # indexes in the streams of the next read
    streaks.update(STREAMS, {"s2"})
    assert streaks.ahead(STREAMS) == [2]


def test_a_stream_left_out_of_a_read_keeps_its_run() -> None:
    """A busy shard with a full read in flight is not read for a round or two: its summary
    still goes with its next read."""
    streaks = Streaks()
    for _ in range(AHEAD_AFTER):
        streaks.update(STREAMS, {"s0", "s1"})
    streaks.update(["s1", "s2"], set())  # s0 not read; s1 read, nothing
    assert streaks.ahead(STREAMS) == [0]
