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


class LockUnavailable(TierError):
    """Shard locks needed by catch-up stayed held by live consumers past the timeout."""
