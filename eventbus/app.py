"""`EventBus`: topics, subscriber registration, lifecycle, publishing and running consumers.

The Redis client comes from `eventbus.client.connection.connect`, the handler's event models from
its signature (`eventbus.consumer.signature`); the consumers run under `eventbus.consumer.running`,
and the blocking facade for synchronous code is `eventbus.sync.SyncBus` (from `EventBus.sync`).
`connect` is re-exported.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from pydantic import BaseModel

from eventbus.client.connection import connect
from eventbus.client.retry import LOST_REPLY
from eventbus.config import Settings, environment_settings
from eventbus.consumer import Subscription
from eventbus.consumer.running import Running, make_consumers, run_consumers
from eventbus.consumer.scope import HandlerScope, Middleware, State
from eventbus.declarations import Declarations
from eventbus.errors import ConfigError, RedisUnavailable
from eventbus.lifecycle import Hook, Lifecycle
from eventbus.locking.member import AsyncRedis
from eventbus.profiles import WireProfile, profile_named
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.middleware import Outgoing, PublishMiddleware, through
from eventbus.request import M, reply_of, requester
from eventbus.session import Session
from eventbus.sync import SyncBus

_sync_lock = threading.Lock()


class EventBus(Declarations, Lifecycle):
    """The application object: declare topics, register subscribers (`Declarations`), publish,
    run.

    ``async with bus:`` connects (checking that Redis answers) and starts the publisher's
    pipeline flusher; `run()` also starts one `Consumer` per subscriber. Leaving it resets the
    bus (`eventbus.lifecycle`): it can be entered again, from this or another event loop.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        redis: AsyncRedis | None = None,
        archive: Any | None = None,
        profile: str | WireProfile = "eventbus",
    ) -> None:
        """`settings`: by default the environment's (`eventbus.config.environment_settings`:
        validated once per distinct set of ``EVENTBUS_*`` / ``REDIS_URL`` values, a copy per bus).

        `archive`: the durable tier's segment store (`eventbus.tier.open_store(url)`). With
        one, a consumer that locks a shard whose group fell behind Redis's first entry (the
        offloader trimmed what it had not read) first handles the missing entries from the
        segments, in order, then reads Redis: no gap. Without one, such entries are skipped.

        `profile`: the wire protocol of every topic of the bus (`eventbus.profiles`):
        ``"eventbus"`` (docs/protocol.md) or ``"verse"``, to publish to and consume beside
        Ruby services built on Verse: Verse's stream names, envelope, shard hash and shard
        locks (docs/verse.md says which guarantees hold beside Verse's consumers). Its parts
        are picked here, once. Raises `ConfigError` for another name, or for an `archive`
        with the verse profile (the durable tier reads eventbus's own entries only)."""
        self.settings = settings or environment_settings()
        self.profile = profile_named(profile)
        if archive is not None and not self.profile.codec.archived:
            raise ConfigError(
                f"the {self.profile.name} profile has no durable tier: the offloader, catch-up "
                "and replay read eventbus's own entries; make the bus without archive="
            )
        self.archive = archive
        self.keys = self.profile.keys(
            self.settings.key_prefix, self.settings.hashtag, self.settings.coordination_slots
        )
        self._given_redis = redis
        self._session: Session | None = None
        self._sync: SyncBus | None = None
        self._topics: dict[str, TopicConfig] = {}
        self.subscriptions: list[Subscription] = []
        self.publications: dict[str, list[type[BaseModel]]] = {}  # `publisher` declarations
        self.consumers: list[Running] = []
        self._on_startup: list[Hook] = []
        self._on_shutdown: list[Hook] = []
        self.state = State()
        """What the service sets up for its handlers (``bus.state.pool = ...`` in an
        ``on_startup`` hook), read by handlers as ``ctx.state`` (`eventbus.consumer.scope`)."""
        self._scope = HandlerScope(self.state, self.publish)
        self._publish_middlewares: list[PublishMiddleware] = []  # `publish_middleware`
        # the scopes of routers' handlers with middlewares of their own: the bus's middlewares,
        # then theirs (`include_router`), keyed by the routers' middlewares
        self._router_scopes: dict[tuple[Middleware, ...], HandlerScope] = {}

    @classmethod
    def from_env(cls, *, profile: str | WireProfile = "eventbus", **overrides: Any) -> EventBus:
        """A bus configured from ``EVENTBUS_*`` / ``REDIS_URL``, with keyword overrides of
        the settings; `profile` as for `EventBus`."""
        return cls(Settings(**overrides), profile=profile)

    # -- publishing -----------------------------------------------------------------------------
    async def publish(
        self,
        topic: str,
        event: BaseModel,
        *,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> str:
        """Publish `event` on `topic`; its shard is chosen by `resource_id`. Returns the entry ID.

        Concurrent calls on a running bus share pipelines. The publish middlewares are entered
        around it (`publish_middleware`). Raises `PayloadTooLarge`, `ShardCountMismatch`,
        `ConfigError`, `PublishError` (see `Publisher.publish`), and what a middleware raises.
        """
        if self._publish_middlewares:  # the one cost of the feature for a bus without any
            message = Outgoing(topic, event, resource_id, dict(headers or {}))
            return await through(self._publish_middlewares, message, self._send)
        return await self.publisher.publish(self.topic(topic), event, resource_id, headers)

    async def _send(self, m: Outgoing) -> str:
        return await self.publisher.publish(self.topic(m.topic), m.event, m.resource_id, m.headers)

    def publish_middleware(self, mw: PublishMiddleware) -> PublishMiddleware:
        """Register ``mw(message)``, a function returning an async context manager, entered
        around every `publish` of this bus (handlers' ``ctx.publish`` and the sync facade's
        too): before its ``yield`` it may change the `Outgoing` message (its headers, say),
        after it read ``message.entry_id`` (`eventbus.publishing.middleware`). They nest in
        registration order, the first outermost. Usable as a decorator; returns `mw`. Raises
        `ConfigError` when `mw` is not callable."""
        if not callable(mw):
            raise ConfigError(f"a publish middleware must be callable, got {type(mw).__name__}")
        self._publish_middlewares.append(mw)
        return mw

    async def publish_many(
        self,
        topic: str,
        events: Iterable[tuple[str, BaseModel]],
        *,
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """Publish ``(resource_id, event)`` pairs in pipelines; returns entry IDs in order."""
        return await self.publisher.publish_many(self.topic(topic), events, headers)

    async def request(
        self,
        topic: str,
        event: BaseModel,
        *,
        resource_id: str,
        timeout_s: float = 30.0,
        reply_model: type[M] | None = None,
        headers: dict[str, str] | None = None,
    ) -> M:
        """Publish `event` as a request and return the reply: the pydantic model a subscriber's
        handler returned, validated as `reply_model`, or its JSON-mode fields (a dict) without
        one. Only a reply that names the request's own entry is returned; others are logged at
        WARNING and ignored (who may answer a topic is its reply streams' ACL: docs/security.md).
        The bus must be entered (``async with bus:``); `eventbus.request` says how.

        :param resource_id: the request's resource (its shard and order, as for `publish`)
        :param timeout_s: seconds to wait for the reply, publishing included (> 0; `math.inf`
            waits for ever)
        :param headers: more headers for the request (the reply headers are eventbus's)
        :raises RequestTimeout: no reply within `timeout_s`; it names the groups that read the
            topic (none: nobody subscribes to it), or says why they could not be listed
        :raises PublishError, PayloadTooLarge, ConfigError: as `publish`; `ConfigError` also for
            a `timeout_s` that is not a number > 0 (0, negative, NaN, a string, None, a bool),
            before anything is published
        """
        number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if not number or not timeout_s > 0:  # (NaN too: it compares False)
            raise ConfigError(
                f"request timeout_s must be a number of seconds > 0, got {timeout_s!r}"
            )
        config = self.topic(topic)
        env = await requester(self.redis, self.keys, config.name).request(
            self.publish, config, event, resource_id, timeout_s, headers
        )
        return reply_of(env, reply_model)

    def sync(self) -> SyncBus:
        """The bus for synchronous code (Flask, Django, threads): one `SyncBus` per bus, shared
        by every thread, running the bus on an event loop thread started on first use.

        ``sb = bus.sync()`` at import, then ``sb.publish(...)`` from any thread (the loop
        starts lazily and is closed at interpreter exit or by ``sb.close()``), or
        ``with bus.sync() as sb:`` (the loop stops when the last such block exits, unless it is
        also used outside one). Safe across ``fork``: a child starts its own.
        """
        with _sync_lock:
            if self._sync is None:
                self._sync = SyncBus(self)
            return self._sync

    # -- consuming ------------------------------------------------------------------------------
    async def run(
        self,
        *,
        stop: anyio.Event | None = None,
        handle_signals: bool = False,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run every registered subscriber until `stop` is set (or SIGTERM/SIGINT arrives, with
        `handle_signals`), then shut down gracefully (see `Consumer.run`). Started with anyio's
        ``await tg.start(bus.run)``, it returns there once every subscriber is reading: an event
        published from then on reaches broadcast subscribers too (they read from where their
        streams ended when they started).

        Raises `ShardCountMismatch` before starting when a topic's stored shard count differs,
        `RedisUnavailable` when Redis cannot be reached at start (once consumers run, they retry).
        """
        if not self.subscriptions:
            raise ConfigError("no subscribers registered on this bus")
        stop = stop or anyio.Event()
        async with contextlib.AsyncExitStack() as stack:
            if not self.running:
                await stack.enter_async_context(self)
            # Checked here, before any task starts, so that a mismatch surfaces as itself
            # rather than wrapped in the task groups' ExceptionGroup; Redis lost since the
            # start's PING is what a start without Redis raises (`Lifecycle.__aenter__`).
            try:
                for sub in self.subscriptions:
                    await self.registry.ensure(sub.topic)
            except LOST_REPLY as exc:
                raise RedisUnavailable.of(self.settings, exc) from exc
            self.consumers = make_consumers(
                self.subscriptions,
                self.redis,
                self.keys,
                self.settings,
                self.registry,
                archive=self.archive,
                profile=self.profile,
            )
            await run_consumers(
                self.consumers, stop, handle_signals=handle_signals, task_status=task_status
            )


__all__ = ["EventBus", "connect"]
