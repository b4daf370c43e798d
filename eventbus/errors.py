"""The error hierarchy: every error eventbus raises is an `EventBusError`.

Each error names the key, topic or object it concerns, so that a log line is enough to act on.
"""

from __future__ import annotations


class EventBusError(Exception):
    """Base class of every error raised by eventbus."""


class ConfigError(EventBusError):
    """A setting or argument is invalid (bad topic name, shard count out of range, ...)."""


class ShardCountMismatch(EventBusError):
    """A topic's stored shard count differs from the configured one.

    Publishing or consuming with another count would send a resource's events to different shard
    streams and silently break per-resource ordering, so both sides refuse to start instead.
    """

    def __init__(self, topic: str, stored: int, configured: int) -> None:
        super().__init__(
            f"topic {topic!r} has {stored} shards in Redis but {configured} are configured; "
            f"set shards={stored} (the shard count of a topic cannot change in place)"
        )
        self.topic, self.stored, self.configured = topic, stored, configured


class PayloadTooLarge(EventBusError):
    """An encoded event is larger than `max_payload_bytes`; it was not published."""

    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(
            f"event for topic {topic!r} encodes to {size} bytes, over the limit of {limit} bytes "
            "(EVENTBUS_MAX_PAYLOAD_BYTES)"
        )
        self.topic, self.size, self.limit = topic, size, limit


class DecodeError(EventBusError):
    """A stream entry cannot be decoded into an event (bad bytes, missing field, wrong schema)."""


class UnknownEventType(DecodeError):
    """An entry's event type is not one the subscriber's handler accepts."""


class PublishError(EventBusError):
    """Redis did not confirm an XADD: the event may or may not be stored (see its event ID).

    From `publish_many`, `entry_ids` lists the IDs of the events that were stored (None for
    the others), in input order.
    """

    entry_ids: list[str | None] | None = None


class RedisUnavailable(EventBusError):
    """Redis could not be reached at start (wrong URL, server down, network)."""
