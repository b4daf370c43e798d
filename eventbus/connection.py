"""`connect`: the one place a redis-py asyncio client is made from the settings."""

from __future__ import annotations

from typing import Any

from eventbus.config import Settings


def connect(settings: Settings) -> Any:
    """A redis-py asyncio client for `settings` (`RedisCluster` when ``cluster`` is set).

    Binary-safe (``decode_responses=False``); connecting happens lazily on first use. Every
    connection has deadlines (`Settings.redis_connect_timeout_s`, `Settings.redis_read_timeout_s`),
    so a server that accepts and never answers fails a call instead of hanging it.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "socket_timeout": settings.redis_read_timeout_s,
    }
    if settings.cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(settings.redis_url, **options)
    import redis.asyncio

    # No transparent retries: redis-py would re-send a command whose reply was lost, and a
    # re-sent XREADGROUP ">" reads past the entries the lost reply delivered into our PEL (they
    # are then handled out of order, after a later recovery), a re-sent XADD stores an event
    # twice. Each caller retries what is safe to retry (eventbus.retry) or recovers first.
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return redis.asyncio.Redis.from_url(settings.redis_url, retry=Retry(NoBackoff(), 0), **options)
