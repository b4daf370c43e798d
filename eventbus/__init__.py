"""eventbus: event-driven microservices on Redis Streams."""

from typing import Any

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
from eventbus.protocol.sharding import shard_of
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


# Paths documented before the package layout of 2026-11-24, kept working: a logging dictConfig
# naming ``eventbus.logs.JsonFormatter``, ``eventbus.health.serve(...)``.
_MOVED = {"logs": "eventbus.ops.logs", "health": "eventbus.ops.health"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'eventbus' has no attribute {name!r}")
