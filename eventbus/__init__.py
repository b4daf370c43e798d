"""eventbus: event-driven microservices on Redis Streams.

The names of `__all__` are imported on first use (`eventbus.ops.lazy`).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from eventbus.ops.lazy import lazy_names

if TYPE_CHECKING:
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


# The names of `__all__` not listed here (but `__version__`) are exceptions of `eventbus.errors`.
__getattr__, __dir__ = lazy_names(
    globals(),
    {
        **dict.fromkeys(__all__, "eventbus.errors"),
        "EventBus": "eventbus.app",
        "Settings": "eventbus.config",
        "Context": "eventbus.consumer",
        "Depends": "eventbus.consumer.depends",
        "Router": "eventbus.router",
        "State": "eventbus.consumer.scope",
        "DeadLetters": "eventbus.dlq",
        "HandlerLogFilter": "eventbus.ops.log_context",
        "log_context": "eventbus.ops.log_context",
        "shard_of": "eventbus.protocol.sharding",
        "TopicConfig": "eventbus.protocol.topics",
        "SyncBus": "eventbus.sync",
    },
)
