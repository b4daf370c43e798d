"""`TrimWatch.due`: which held shards a round checks for entries trimmed before the group read
them: new ones at once, others every `trim_check_s`, an idle caught-up one every `IDLE_EVERY`
intervals (nothing was added to it that a ``MAXLEN`` trim could take unread)."""

from __future__ import annotations

from eventbus import EventBus, Settings
from eventbus.consumer.shards import HeldShard
from eventbus.consumer.trims import IDLE_EVERY, TrimWatch, _Baseline
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.testing import memory_redis

INTERVAL = 5.0
SHAPE = (3, 3, b"1-3", b"0-0", b"1-1")  # an `XINFO STREAM` shape: 3 entries, none deleted


def watch() -> TrimWatch:
    bus = EventBus(Settings(redis_url="redis://in-memory", shards=4, trim_check_s=INTERVAL))
    return TrimWatch(Member(memory_redis(), bus.keys, bus.settings, "t", "g", "me-1", EVENTBUS))


def held(shard: int, idle_since: float | None) -> HeldShard:
    return HeldShard(shard, f"s{shard}", token=1, generation=1, idle_since=idle_since)


def test_a_new_shard_is_due_at_once_and_a_read_one_every_interval() -> None:
    w = watch()
    new = held(0, None)
    assert w.due([new], now=100.0) == [new]
    w._base[0] = _Baseline(1, 0, checked_at=100.0, caught_up=SHAPE)
    busy = held(0, None)  # its last read got entries
    assert w.due([busy], now=100.0 + INTERVAL - 0.1) == []
    assert w.due([busy], now=100.0 + INTERVAL) == [busy]
    moved = HeldShard(0, "s0", token=2, generation=2)  # taken again since: a new acquisition
    assert w.due([moved], now=100.1) == [moved]


def test_an_idle_caught_up_shard_waits_idle_every_intervals() -> None:
    w = watch()
    w._base[1] = _Baseline(1, 0, checked_at=100.0, caught_up=SHAPE)
    idle = held(1, idle_since=99.0)  # read empty since before the check
    assert w.due([idle], now=100.0 + INTERVAL) == []
    assert w.due([idle], now=100.0 + INTERVAL * IDLE_EVERY - 0.1) == []
    assert w.due([idle], now=100.0 + INTERVAL * IDLE_EVERY) == [idle]


def test_a_shard_read_since_its_check_or_behind_at_it_waits_one_interval() -> None:
    w = watch()
    w._base[2] = _Baseline(1, 0, checked_at=100.0, caught_up=SHAPE)
    read_since = held(2, idle_since=101.0)  # got entries after the check, empty reads since
    assert w.due([read_since], now=100.0 + INTERVAL) == [read_since]
    w._base[3] = _Baseline(1, 0, checked_at=100.0, caught_up=None)  # a lag at the last check
    behind = held(3, idle_since=99.0)
    assert w.due([behind], now=100.0 + INTERVAL) == [behind]
