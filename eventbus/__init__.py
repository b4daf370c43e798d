"""eventbus: event-driven microservices on Redis Streams."""

from eventbus.app import EventBus
from eventbus.config import Settings
from eventbus.consumer import Context
from eventbus.errors import (
    ConfigError,
    DecodeError,
    EventBusError,
    PayloadTooLarge,
    PublishError,
    RedisUnavailable,
    ShardCountMismatch,
    UnknownEventType,
)
from eventbus.sharding import shard_of
from eventbus.sync import SyncBus

__all__ = [
    "ConfigError",
    "Context",
    "DecodeError",
    "EventBus",
    "EventBusError",
    "PayloadTooLarge",
    "PublishError",
    "RedisUnavailable",
    "Settings",
    "ShardCountMismatch",
    "SyncBus",
    "UnknownEventType",
    "shard_of",
]
