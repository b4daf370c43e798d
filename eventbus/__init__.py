"""eventbus: event-driven microservices on Redis Streams."""

from importlib.metadata import PackageNotFoundError, version

from eventbus.app import EventBus
from eventbus.config import Settings
from eventbus.consumer import Context
from eventbus.consumer.depends import Depends
from eventbus.consumer.scope import State
from eventbus.dlq import DeadLetters
from eventbus.errors import (
    ConfigError,
    DecodeError,
    EventBusError,
    HandlerTimeout,
    InvalidReply,
    PayloadTooLarge,
    PublishError,
    RedisUnavailable,
    RequestTimeout,
    ShardCountMismatch,
    UnknownEventType,
)
from eventbus.ops.log_context import HandlerLogFilter, log_context
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicConfig
from eventbus.router import Router
from eventbus.sync import SyncBus

try:
    __version__ = version("eventbus")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ConfigError",
    "Context",
    "DeadLetters",
    "DecodeError",
    "Depends",
    "EventBus",
    "EventBusError",
    "HandlerLogFilter",
    "HandlerTimeout",
    "InvalidReply",
    "PayloadTooLarge",
    "PublishError",
    "RedisUnavailable",
    "RequestTimeout",
    "Router",
    "Settings",
    "ShardCountMismatch",
    "State",
    "SyncBus",
    "TopicConfig",
    "UnknownEventType",
    "__version__",
    "log_context",
    "shard_of",
]
