"""Errors of the durable tier; all are `EventBusError`s and name the object or shard concerned."""

from __future__ import annotations

from eventbus.errors import EventBusError


class TierError(EventBusError):
    """Base class of durable-tier errors."""


class StoreError(TierError):
    """The object store refused or failed an operation (after obstore's own retries)."""


class CorruptSegment(TierError):
    """A segment object cannot be trusted: truncated, bad checksum, wrong schema or metadata,
    entries out of order or outside the range its key names. `key` is the object key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt segment {key!r}: {reason}")
        self.key, self.reason = key, reason


class CorruptGapRecord(TierError):
    """A gap record object (`eventbus.tier.gaps.Gap` as JSON) cannot be parsed: not JSON, not
    an object, or a field of the wrong type. `key` is the object key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt gap record {key!r}: {reason}")
        self.key, self.reason = key, reason


class CorruptCheckpoint(TierError):
    """A shard's fields of the offloader checkpoint hash (`eventbus.tier.checkpoint`) are not
    what the offloader writes: an entry ID, ``<first> <last> <entries>``, a count. `key` names
    the hash and the shard."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt checkpoint {key}: {reason}")
        self.key, self.reason = key, reason


class LockUnavailable(TierError):
    """Shard locks needed by catch-up stayed held by live consumers past the timeout."""


class CatchUpOutpaced(TierError):
    """A shard's catch-up fell behind the stream's first entry (the offloader trimmed past the
    group's position) again and again: `rounds` passes over the archive then Redis did not
    catch it up, because its stream grows faster than the handler keeps up while the
    offloader trims what is older than ``hot_window_s``. Names `topic`, `group`, `shard`, the
    group's position `delivered`, the stream's `first` and `last` entry IDs (None: empty) and
    `behind_s`, the seconds of entry time from the group's position to the stream's last
    entry. The group keeps its progress: a later catch-up goes on from `delivered`."""

    def __init__(
        self,
        topic: str,
        group: str,
        shard: int,
        rounds: int,
        delivered: object,
        first: object,
        last: object,
        behind_s: float,
    ) -> None:
        super().__init__(
            f"catch-up of {topic}/{group}: shard {shard} is still behind its stream's first "
            f"entry after {rounds} rounds (archive, then Redis): the group is at {delivered}, "
            f"the stream holds {first} .. {last}, {behind_s:.1f} s of entries behind its last "
            "entry. The stream grows faster than the handler catches up while the offloader "
            "trims past the group: handle faster, raise hot_window_s, or raise max_rounds"
        )
        self.topic, self.group, self.shard, self.rounds = topic, group, shard, rounds
        self.delivered, self.first, self.last, self.behind_s = delivered, first, last, behind_s
