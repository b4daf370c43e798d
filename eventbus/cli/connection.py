"""How a command reaches Redis: the settings (with ``--redis-url`` as an override) and a bus
whose Redis answered."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus.app import EventBus
from eventbus.cli.output import remember_url
from eventbus.config import Settings
from eventbus.errors import ConfigError, RedisUnavailable

RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Overrides REDIS_URL / EVENTBUS_REDIS_URL.")
]


def settings_from(redis_url: str | None) -> Settings:
    """The settings (environment, `redis_url` overriding); raises `ValidationError`."""
    if redis_url:
        remember_url(redis_url)
    for name in ("EVENTBUS_REDIS_URL", "REDIS_URL"):
        if os.environ.get(name):
            remember_url(os.environ[name])
    settings = Settings(redis_url=redis_url) if redis_url else Settings()
    remember_url(settings.redis_url)
    return settings


async def open_bus(settings: Settings) -> EventBus:
    """An `EventBus` whose Redis answered a PING; raises `RedisUnavailable` (URL redacted)
    when it cannot be reached, refuses the credentials or does not answer in time."""
    bus = EventBus(settings)
    try:
        await bus.redis.ping()
    except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError) as exc:
        await bus.aclose()
        raise RedisUnavailable.of(settings, exc) from None
    return bus


async def stored_shards(bus: EventBus, topic: str) -> int:
    """The shard count stored for `topic`; raises `ConfigError` for a topic never registered."""
    shards = (await bus.registry.stored()).get(topic)
    if shards is None:
        raise ConfigError(f"unknown topic {topic!r}")
    return shards
