"""eventbus: event-driven microservices on Redis Streams.

The names of `__all__` are imported on first use (`eventbus.ops.lazy`).
"""

from typing import TYPE_CHECKING, Any

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
_lazy, __dir__ = lazy_names(
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


def __getattr__(name: str) -> Any:
    if name != "__version__":
        return _lazy(name)
    # on use: importlib.metadata costs every process ~30 ms
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("eventbus")
    except PackageNotFoundError:  # run from a source tree that was never installed
        value = "0+unknown"
    globals()[name] = value
    return value
