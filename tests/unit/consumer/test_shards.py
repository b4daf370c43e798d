"""The held-shard table (`eventbus.consumer.shards.ShardTable`): pure bookkeeping, no Redis."""

from __future__ import annotations

from eventbus.consumer.shards import ShardTable
from eventbus.locking.locks import Grant, LockState

HELD, FREE, DEAD = LockState.HELD, LockState.TAKEN_FREE, LockState.TAKEN_FROM_DEAD


def table(n: int = 4) -> ShardTable:
    return ShardTable([f"s:{i}" for i in range(n)])


def grants(*triples: tuple[int, int, LockState]) -> dict[int, Grant]:
    return {s: Grant(s, token, state) for s, token, state in triples}


def test_first_grants_are_all_new_with_distinct_generations() -> None:
    t = table()
    lost, new = t.apply(grants((0, 1, FREE), (2, 5, DEAD)))
    assert (lost, sorted(new)) == ([], [0, 2])
    assert {s: (h.stream, h.token) for s, h in t.held.items()} == {0: ("s:0", 1), 2: ("s:2", 5)}
    assert t.held[0].generation != t.held[2].generation


def test_a_lock_still_held_under_the_same_token_keeps_its_state() -> None:
    t = table()
    t.apply(grants((1, 3, FREE)))
    before = t.held[1]
    before.in_flight = 2
    lost, new = t.apply(grants((1, 3, HELD)))
    assert (lost, new) == ([], [])
    assert t.held[1] is before and before.in_flight == 2


def test_shards_missing_from_the_grants_are_lost() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE), (3, 1, FREE)))
    lost, new = t.apply(grants((1, 1, HELD)))
    assert (sorted(lost), new) == ([0, 3], [])
    assert set(t.held) == {1}


def test_a_lock_re_taken_under_a_new_token_is_new_with_a_new_generation() -> None:
    """Lost and re-taken between two rounds (the token grew): the old acquisition's entries
    and acks must not count for the new one."""
    t = table()
    t.apply(grants((2, 4, FREE)))
    old = t.held[2]
    _, new = t.apply(grants((2, 6, HELD)))  # same state HELD, but another token
    assert new == [2]
    assert t.held[2] is not old and t.held[2].token == 6
    assert t.held[2].generation > old.generation


def test_a_grant_marked_new_under_the_same_token_is_new() -> None:
    t = table()
    t.apply(grants((0, 7, FREE)))
    first = t.held[0].generation
    _, new = t.apply(grants((0, 7, DEAD)))
    assert new == [0] and t.held[0].generation != first


def test_generations_are_never_reused() -> None:
    t = table(2)
    seen = set()
    for token in range(1, 6):
        t.apply(grants((0, token, FREE)))
        seen.add(t.held[0].generation)
        t.apply({})
    assert len(seen) == 5


def test_current_is_true_only_for_the_held_generation() -> None:
    t = table()
    t.apply(grants((1, 1, FREE)))
    gen = t.held[1].generation
    assert t.current(1, gen)
    assert not t.current(1, gen + 1)
    assert not t.current(0, gen)  # not held
    t.apply(grants((1, 2, FREE)))
    assert not t.current(1, gen)  # re-taken: the old generation is stale
    regen = t.held[1].generation
    t.apply({})
    assert not t.current(1, regen)  # lost


def test_of_stream_finds_the_held_shard_by_stream_key() -> None:
    t = table()
    t.apply(grants((3, 1, FREE)))
    assert t.of_stream(b"s:3") is t.held[3]
    assert t.of_stream(b"s:0") is None  # a shard of the topic, not held


def test_mark_surplus_drains_the_least_busy_shards_above_the_share() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE), (2, 1, FREE), (3, 1, FREE)))
    for s, busy in {0: 5, 1: 0, 2: 9, 3: 1}.items():
        t.held[s].in_flight = busy
    t.mark_surplus(2)
    assert {s for s, h in t.held.items() if h.draining} == {1, 3}
    assert sorted(h.shard for h in t.readable()) == [0, 2]
    t.mark_surplus(2)  # already at the share among readable shards: nothing more drains
    assert sorted(h.shard for h in t.readable()) == [0, 2]


def test_mark_surplus_at_or_under_the_share_drains_nothing() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE)))
    t.mark_surplus(2)
    t.mark_surplus(3)
    assert len(t.readable()) == 2


def test_to_release_waits_for_idle_s_of_empty_reads() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE)))
    assert t.to_release(set(), now=100.0, idle_s=0.5) == []  # first empty read starts the clock
    assert t.to_release(set(), now=100.4, idle_s=0.5) == []
    assert sorted(t.to_release(set(), now=100.5, idle_s=0.5)) == [0, 1]


def test_to_release_restarts_the_clock_on_entries_or_work_in_flight() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE)))
    t.to_release(set(), now=10.0, idle_s=1.0)
    t.held[1].in_flight = 1
    assert t.to_release({0}, now=10.9, idle_s=1.0) == []  # 0 read entries, 1 is busy
    assert t.held[0].idle_since is None and t.held[1].idle_since is None
    t.held[1].in_flight = 0
    assert t.to_release(set(), now=11.5, idle_s=1.0) == []  # the clock restarted at 11.5
    assert sorted(t.to_release(set(), now=12.5, idle_s=1.0)) == [0, 1]


def test_to_release_lets_a_drained_surplus_shard_go_at_once() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE)))
    t.held[0].in_flight = 3
    t.mark_surplus(1)  # shard 1 (idle) drains; shard 0 (busy) stays
    assert t.held[1].draining
    assert t.to_release(set(), now=0.0, idle_s=60.0) == [1]
    t.held[0].draining, t.held[0].in_flight = True, 1
    assert t.to_release(set(), now=0.0, idle_s=60.0) == [1]  # 0 is not drained yet


def test_forget_drops_shards_and_ignores_unknown_ones() -> None:
    t = table()
    t.apply(grants((0, 1, FREE), (1, 1, FREE)))
    t.forget([0, 3])
    assert set(t.held) == {1}
