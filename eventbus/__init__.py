"""eventbus: event-driven microservices on Redis Streams.

The names of `__all__` are imported on first use (PEP 562, `__getattr__`): a process that
imports one submodule (a Spark worker unpickling ``eventbus.spark.writer``, a CLI command) does
not pay for the bus, the consumer and Redis clients it does not use.
"""

from typing import TYPE_CHECKING, Any

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


_LAZY = {
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
    **dict.fromkeys(
        (
            "ConfigError",
            "DecodeError",
            "EventBusError",
            "HandlerTimeout",
            "InvalidReply",
            "PayloadTooLarge",
            "PublishError",
            "RedisUnavailable",
            "RequestTimeout",
            "ShardCountMismatch",
            "UnknownEventType",
        ),
        "eventbus.errors",
    ),
}


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    if name == "__version__":  # on use: importlib.metadata costs every process ~30 ms
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("eventbus")
        except PackageNotFoundError:  # run from a source tree that was never installed
            value = "0+unknown"
        globals()[name] = value
        return value
    raise AttributeError(f"module 'eventbus' has no attribute {name!r}")
