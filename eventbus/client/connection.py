"""`connect`: the one place a redis-py asyncio client is made from the settings."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from eventbus.client.credentials import Credentials, from_url, split_credentials
from eventbus.config import Settings

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster


def connect(settings: Settings) -> Any:
    """A redis-py asyncio client for `settings`: `RedisCluster` when ``cluster`` is set, the
    Sentinel-managed primary (``Sentinel(...).master_for(service)``) when ``sentinels`` are,
    otherwise a plain `Redis` of ``redis_url``.

    Binary-safe (``decode_responses=False``); connecting happens lazily on first use. With a
    ``rediss://`` URL the ``tls_*`` settings give the CA and client certificate files. Every
    connection has deadlines (`Settings.redis_connect_timeout_s`, `Settings.redis_read_timeout_s`),
    so a server that accepts and never answers fails a call instead of hanging it. The user
    name and password (of the URL, and the sentinels' own) are passed as a redis-py
    `CredentialProvider` (`eventbus.client.credentials`): no repr or str of the client, its
    pool, nodes or connections shows a password.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "socket_timeout": settings.redis_read_timeout_s,
        **settings.tls_options,  # CA and client certificate files (rediss:// only)
    }
    if settings.cluster:
        return _guard_cluster(from_url(_cluster_class(), settings.redis_url, **options))
    import redis.asyncio

    # No transparent retries: redis-py would re-send a command whose reply was lost, and a
    # re-sent XREADGROUP ">" reads past the entries the lost reply delivered into our PEL (they
    # are then handled out of order, after a later recovery), a re-sent XADD stores an event
    # twice. Each caller retries what is safe to retry (eventbus.client.retry) or recovers first.
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    if settings.sentinels:
        return _sentinel_primary(settings, options, Retry(NoBackoff(), 0))
    client: Any = from_url(
        redis.asyncio.Redis, settings.redis_url, retry=Retry(NoBackoff(), 0), **options
    )
    pool = client.connection_pool  # its class follows the URL's scheme (TCP, TLS, unix socket)
    pool.connection_class = timed_send(pool.connection_class)
    return client


def _sentinel_primary(settings: Settings, options: dict[str, Any], no_retry: Any) -> Any:
    """The primary of `settings.sentinel_service`, found through `settings.sentinels`.

    redis-py's `SentinelConnectionPool` asks the sentinels for the primary's address whenever a
    connection (re)connects, refuses a primary a sentinel reports down, and turns a ``READONLY``
    reply (the node was demoted) into a `ConnectionError` that drops the connection: callers see
    a failover as connection errors, which they already handle, and their next connection goes
    to the promoted replica. Credentials, database and TLS of the primary come from
    ``redis_url`` (its host and port are not used); the sentinels get the same socket deadlines
    and TLS, and their own ``sentinel_username`` / ``sentinel_password``.
    """
    from redis.asyncio.connection import parse_url
    from redis.asyncio.sentinel import Sentinel

    bare_url, credentials = split_credentials(settings.redis_url)
    parsed = parse_url(bare_url)
    tls = settings.redis_url.startswith("rediss:")
    primary: dict[str, Any] = {
        k: v
        for k, v in parsed.items()
        if k not in ("host", "port", "path", "connection_class") and v is not None
    }
    primary |= options | {"retry": no_retry}
    if credentials is not None:
        primary["credential_provider"] = credentials
    sentinel_options: dict[str, Any] = options | {"retry": no_retry}
    primary["connection_class"] = timed_send(_primary_connection_classes()[tls])
    if tls:
        sentinel_options |= (
            {"ssl": True}
            | {k: v for k, v in parsed.items() if k.startswith("ssl_")}
            | settings.tls_options
        )
    secret = settings.sentinel_password
    sentinel_password = None if secret is None else secret.get_secret_value()
    if settings.sentinel_username or sentinel_password:  # as redis-py: AUTH only with either
        sentinel_options["credential_provider"] = Credentials(
            settings.sentinel_username, sentinel_password
        )
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses, sentinel_kwargs=sentinel_options
    )
    return sentinel.master_for(settings.sentinel_service, **primary)


_CLASSES: dict[bool, type] = {}


def _primary_connection_classes() -> dict[bool, type]:
    """Connection classes of the Sentinel-managed primary, without TLS (False) and with (True).

    redis-py's `SentinelManagedConnection` asks the sentinels for the primary only in
    ``connect()``. A connection that is reconnected by ``send_packed_command`` (which the
    publisher's sender uses for its hiredis-packed pipelines) goes through
    ``connect_check_health()`` instead and so redials the *old* address forever after a
    failover (redis-py 6.4). These subclasses resolve the primary in ``connect_check_health``,
    whichever way a connection is (re)connected, once per connect.
    """
    if _CLASSES:
        return _CLASSES
    from redis.asyncio.connection import SSLConnection
    from redis.asyncio.sentinel import SentinelManagedConnection

    class SentinelPrimaryConnection(SentinelManagedConnection):
        async def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if not self.is_connected:
                self.host, self.port = await self.connection_pool.get_master_address()
            await super().connect_check_health(check_health, retry_socket_connect)

        async def _connect_retry(self) -> None:
            if not self.is_connected:  # the address is resolved in connect_check_health
                await self.connect_check_health(
                    check_health=self.connection_pool.check_connection,
                    retry_socket_connect=False,
                )

    class SentinelPrimarySSLConnection(SentinelPrimaryConnection, SSLConnection):
        pass

    _CLASSES.update({False: SentinelPrimaryConnection, True: SentinelPrimarySSLConnection})
    return _CLASSES


@functools.cache
def _cluster_class() -> type[RedisCluster]:
    """redis-py's `RedisCluster`, except that failing to learn the topology is a connection error.

    When no startup or known node answers (all restarting, a partition) or the slots are not all
    served (a failover in progress), redis-py raises `RedisClusterException`, which is not a
    `RedisError`: every loop that retries Redis errors (heartbeats, reads, acks) would die of it
    instead of retrying. Seen in the chaos harness (`all --cluster` under a CPU hog): a
    consumer's heartbeat loop died of "Redis Cluster cannot be connected". It is raised as a
    `ConnectionError` (the original chained), which callers already treat as a lost reply.
    """
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisClusterException

    # made once, on first use: the Cluster client is imported only when one is asked for
    class Cluster(RedisCluster):
        async def initialize(self) -> Cluster:
            try:
                await super().initialize()
            except RedisClusterException as exc:
                raise RedisConnectionError(f"Redis Cluster topology unknown: {exc}") from exc
            return self

    return Cluster


def _guard_cluster(client: Any) -> Any:
    """`client` (a `RedisCluster`) with connections that fail with `ConnectionError` when they
    were closed under a caller.

    When a Cluster's topology changes (failover, resharding), redis-py's `NodesManager`
    disconnects every connection of a node it drops, including those a task is using at that
    moment; that task's next write then finds no socket writer and raises `AttributeError`
    (``'NoneType' object has no attribute 'writelines'``), which no retry and no caller treats as
    a lost connection (the family of redis/redis-py#4287). Seen in the cluster failover test:
    the consumer's ack loop died of it. `timed_send`'s write raises `ConnectionError` instead.
    The asyncio Cluster client takes no connection class, so the class is set where its nodes
    are made: the options every new node gets, and the startup nodes already made.
    """
    guarded = timed_send(client.connection_kwargs["connection_class"])
    client.connection_kwargs["connection_class"] = guarded
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = guarded
    return client


@functools.cache
def timed_send(base: type) -> type:
    """A subclass of the redis-py asyncio connection class `base` whose writes are bounded by
    time and by the bytes a connection may hold unsent, on every Python (3.11 to 3.13) and
    event loop (asyncio's, uvloop).

    Bytes: a write goes through ``StreamWriter.write`` and then waits in ``drain()`` while the
    transport holds more than its high-water mark (64 KiB by default) unsent, so a connection
    holds at most that plus the command being written. redis-py writes with ``writelines``,
    and asyncio's socket transport on CPython 3.12.0-3.12.8 and 3.13.0-3.13.1 never pauses its
    protocol after a ``writelines`` (CPython gh-127655): ``drain()`` returns at once and every
    command to a peer that stopped reading stays in memory (measured: 200 writes of 1 MiB,
    205 MB buffered, no error; 3.11 and uvloop stop at the third).

    Time: a write on a connected socket is bounded by ``socket_timeout`` (when set) with
    `asyncio.timeout` (a timer) instead of redis-py's `asyncio.wait_for`, which on Python 3.11
    runs the write in a new Task: measured on this project's 2-core machine, a PING round trip
    cost 166-178 us of CPU with a socket timeout and 134-138 us without (3.12 made ``wait_for``
    a timer too). A write that does not finish in ``socket_timeout`` seconds drops the
    connection and raises redis-py's `TimeoutError`; an `OSError` drops it and raises
    `ConnectionError`; a write of a connection another task closed raises `ConnectionError`
    (see `_guard_cluster`). A dropped connection is aborted, its unsent bytes discarded (a
    graceful close would keep them until a peer that does not read reads). Connecting and
    health checks keep redis-py's own path (its ``wait_for``, with this write under it).
    """
    import asyncio

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    class TimedSend(base):  # type: ignore[misc]
        async def _send_packed_command(self, command: Any) -> None:
            writer = self._writer
            if writer is None:  # closed by another task (see _guard_cluster)
                raise RedisConnectionError("connection closed by another task while in use")
            # write(), not writelines(): see the docstring (CPython gh-127655). One chunk is
            # written as is (join returns it); several are joined, as 3.11's writelines does.
            writer.write(b"".join(command))
            try:
                await writer.drain()  # waits while the transport is over its high-water mark
            except BaseException:  # timed out, cancelled, or lost: the command is partial
                writer.transport.abort()  # drop the unsent bytes now, not when the peer reads
                raise

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not self.is_connected or (check_health and self.health_check_interval):
                await super().send_packed_command(command, check_health)
                return
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            try:
                async with asyncio.timeout(self.socket_timeout or None):  # 0, None: no deadline
                    await self._send_packed_command(command)
            except TimeoutError:  # before OSError, its base class
                await self.disconnect(nowait=True)
                raise RedisTimeoutError("Timeout writing to socket") from None
            except OSError as exc:
                await self.disconnect(nowait=True)
                raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
            except BaseException:  # a write cut short (cancelled) leaves a partial command
                await self.disconnect(nowait=True)
                raise

    TimedSend.__name__ = TimedSend.__qualname__ = f"TimedSend{base.__name__}"
    return TimedSend
