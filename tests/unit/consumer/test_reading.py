"""`reading.strays`: which shards of a read round have entries pending for another consumer
(fenced delivery), from the round's XPENDING summaries, raw or parsed by redis-py."""

from __future__ import annotations

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
