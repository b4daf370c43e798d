"""`EventBus`: topics, subscriber registration, lifecycle, publishing and running consumers.

The Redis client comes from `eventbus.client.connection.connect`, the handler's event models from
its signature (`eventbus.consumer.signature`); the consumers run under `eventbus.consumer.running`,
and the blocking facade for synchronous code is `eventbus.sync.SyncBus` (from `EventBus.sync`).
`connect` is re-exported.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, Unpack

import anyio
from anyio.abc import TaskStatus
from pydantic import BaseModel

from eventbus.client.connection import connect
from eventbus.client.retry import LOST_REPLY
from eventbus.config import Settings
from eventbus.consumer import Handler, Subscription
from eventbus.consumer.options import SubscriberArgs, SubscriberOptions
from eventbus.consumer.registration import add_handler
from eventbus.consumer.running import Running, make_consumers, run_consumers
from eventbus.consumer.scope import HandlerScope, Middleware, State
from eventbus.errors import ConfigError, RedisUnavailable, ReservedEventType
from eventbus.lifecycle import Hook, Lifecycle
from eventbus.locking.member import AsyncRedis
from eventbus.profiles import WireProfile, profile_named
from eventbus.protocol.codec import RESERVED_TYPE_PREFIX, event_type_of
from eventbus.protocol.keys import check_event_type
from eventbus.protocol.retention import Retention
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.middleware import Outgoing, PublishMiddleware, through
from eventbus.request import M, reply_of, requester
from eventbus.router import Router
from eventbus.session import Session
from eventbus.sync import SyncBus

H = TypeVar("H", bound=Handler)
_sync_lock = threading.Lock()


class EventBus(Lifecycle):
    """The application object: declare topics, register subscribers, publish, run.

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
        """`archive`: the durable tier's segment store (`eventbus.tier.open_store(url)`). With
        one, a consumer that locks a shard whose group fell behind Redis's first entry (the
        offloader trimmed what it had not read) first handles the missing entries from the
        segments, in order, then reads Redis: no gap. Without one, such entries are skipped.

        `profile`: the wire protocol of every topic of the bus (`eventbus.profiles`):
        ``"eventbus"`` (docs/protocol.md) or ``"verse"``, to publish to and consume beside
        Ruby services built on Verse: Verse's stream names, envelope, shard hash and shard
        locks (docs/verse.md says which guarantees hold beside Verse's consumers). Its parts
        are picked here, once. Raises `ConfigError` for another name, or for an `archive`
        with the verse profile (the durable tier reads eventbus's own entries only)."""
        self.settings = settings or Settings()
        self.profile = profile_named(profile)
        if archive is not None and not self.profile.codec.native:
            raise ConfigError(
                f"the {self.profile.name} profile has no durable tier: the offloader, catch-up "
                "and replay read eventbus's own entries; make the bus without archive="
            )
        self.archive = archive
        self.keys = self.profile.keys(self.settings.key_prefix, self.settings.hashtag)
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

    # -- declaration ----------------------------------------------------------------------------
    def topic(
        self,
        name: str,
        *,
        shards: int | None = None,
        maxlen: int | None = None,
        retention: Retention | None = None,
    ) -> TopicConfig:
        """Declare (or look up) a topic. Unset values come from the settings. `retention` is
        ``"maxlen"`` or ``"acked"`` (`eventbus.protocol.retention`).

        Raises `ConfigError` when the topic was already declared with other values, or for an
        invalid name (checked by `TopicConfig` when the topic is first seen, not on every call),
        or a shard count the bus's wire profile cannot serve (the verse profile: 1..32).
        """
        existing = self._topics.get(name)
        if existing is not None:
            if (
                (shards is not None and shards != existing.shards)
                or (maxlen is not None and maxlen != existing.maxlen)
                or (retention is not None and retention != existing.retention)
            ):
                raise ConfigError(f"topic {name!r} is already declared as {existing}")
            return existing
        # `is None`, not `or`: an explicit 0 must be refused by TopicConfig, not replaced
        config = TopicConfig(
            name,
            self.settings.shards if shards is None else shards,
            self.settings.maxlen if maxlen is None else maxlen,
            self.settings.retention if retention is None else retention,
        )
        self.profile.check_shards(config.shards)
        self._topics[name] = config
        return config

    def subscriber(self, topic: str, **options: Unpack[SubscriberArgs]) -> Callable[[H], H]:
        """Register the decorated function as the handler of `topic` for consumer group `group`.
        The keyword `options` are those of `SubscriberArgs` (``group=``, ``ack=``, ...; their
        table: docs/operations.md), described below.

        The handler is ``async def h(event: Model, ctx: Context)`` (``ctx`` optional; a plain
        ``def`` runs in a worker thread). ``Model`` is a pydantic model or a union of models,
        or ``dict`` / ``bytes`` for the raw payload. Several handlers may subscribe to one
        (topic, group): each event type goes to its handler, through one consumer and one queue
        per resource (`eventbus.consumer.routing`); `type_name` names the type(s) a handler
        takes instead of its model's (aliases). `on_unknown` decides, for the (topic, group),
        what happens to a type no handler takes: ``"dead_letter"`` (default) or ``"skip"``.
        The options that shape the consumer (all but `type_name`) are the (topic, group)'s:
        a further handler leaves them unset or repeats them. ``ack="after"`` (default) acks
        after the handler succeeded (at-least-once); ``ack="before"`` reads with NOACK
        (at-most-once). `broadcast`: every running instance gets every event (no `group`;
        `eventbus.consumer.broadcast` says what is and is not guaranteed).

        A failing handler is retried in place up to `max_attempts` times (default from the
        settings), waiting ``retry_base_s * 2**(n-1)`` (at most `retry_max_s`, times a random
        0.5..1) while the resource's later events wait. Then the entry is dead-lettered and
        `on_failure` decides: ``"continue"`` with the resource's next event, or ``"park"`` the
        resource (its later events are dead-lettered in order until an operator requeues or
        drops it: `eventbus.dlq`, ``eventbus dlq``). With `dedup_window_s`, an event ID handled
        successfully is remembered that long (seconds) and skipped if delivered again.
        `handler_timeout_s` (seconds; default the settings' `handler_timeout_s`, 0: no limit)
        bounds each attempt: an async handler is cancelled, a sync one abandoned (its thread
        runs on, unwaited), and the attempt counts as failed (`HandlerTimeout`).
        With `batch`, the handler takes lists: ``async def h(events: list[Model], ctxs:
        list[Context])``, called with up to `max_batch` consecutive entries of one shard
        (`eventbus.consumer.batching`; docs/semantics.md gives the guarantees).
        Raises `ConfigError` for a bad name, option, or handler signature (and for
        ``on_failure="park"`` in the verse profile, which orders by shard), and
        `ReservedEventType` for a model whose event type starts with ``__eventbus.``.
        """
        return self._subscriber(topic, options, self._scope)

    def _subscriber(
        self, topic: str, options: SubscriberArgs, scope: HandlerScope
    ) -> Callable[[H], H]:
        """`subscriber`, its handlers entered in `scope`'s middlewares (`include_router`)."""
        resolved = SubscriberOptions.of(self.settings, topic, **options)

        if resolved.on_failure == "park" and not self.profile.codec.native:
            raise ConfigError(
                f"subscriber of topic {topic!r}: on_failure='park' needs per-resource order, "
                f"and the {self.profile.name} profile orders by shard (docs/verse.md)"
            )

        def register(handler: H) -> H:
            config = self.topic(topic)
            existing = next(
                (
                    s
                    for s in self.subscriptions
                    if (s.topic.name, s.group) == (topic, resolved.group)
                ),
                None,
            )
            if existing is not None and existing.scope is not scope:
                raise ConfigError(
                    f"topic {topic!r}, group {resolved.group!r}: its handlers run inside "
                    "other middlewares (a router's): give this handler the same router, or "
                    "another group"
                )
            add_handler(self.subscriptions, config, resolved, handler, scope)
            return handler

        return register

    def publishes(self, topic: str, *models: type[BaseModel]) -> None:
        """Declare that this service publishes events of `models` on `topic` (``bus.publishes(
        "invoices", Invoiced)``), for the contract ``eventbus describe`` prints and writes as
        AsyncAPI (`eventbus.contract`). A declaration sends nothing and restricts nothing: it
        documents what the module's ``publish`` calls send. Declaring again adds models. (Named
        ``publishes``: ``bus.publisher`` is the bus's `Publisher`.)

        Raises `ConfigError` for a bad topic name, no model or one that is not a pydantic
        model, `ReservedEventType` for a model whose event type starts with ``__eventbus.``,
        and `InvalidEventType` for one that is not 1-200 characters of ``[A-Za-z0-9_.-]``.
        """
        config = self.topic(topic)
        if not models or not all(isinstance(m, type) and issubclass(m, BaseModel) for m in models):
            raise ConfigError(f"publishes of topic {topic!r}: give pydantic model classes")
        for model in models:
            if event_type_of(model).startswith(RESERVED_TYPE_PREFIX):
                raise ReservedEventType(event_type_of(model), f"publishes of topic {topic!r}")
            check_event_type(event_type_of(model), f"publishes of topic {topic!r}")
        declared = self.publications.setdefault(config.name, [])
        declared += [m for m in models if m not in declared]

    def middleware(self, mw: Middleware) -> Middleware:
        """Register ``mw(event, ctx)``, a function returning an async context manager (e.g. an
        ``@contextlib.asynccontextmanager`` function), entered around every attempt of every
        handler of this bus: single, batch (with the lists the handler gets) and broadcast, and
        catch-up. Middlewares nest in registration order, the first outermost; one registered
        after the consumers started applies from their next start. Its exception fails the
        attempt like the handler's. Usable as a decorator; returns `mw`. Raises `ConfigError`
        when `mw` is not callable. See `eventbus.consumer.scope`."""
        if not callable(mw):
            raise ConfigError(f"a middleware must be callable, got {type(mw).__name__}")
        self._scope.middlewares.append(mw)
        for own, scope in self._router_scopes.items():  # the bus's stay outside a router's
            scope.middlewares[:] = [*self._scope.middlewares, *own]
        return mw

    def include_router(self, router: Router) -> None:
        """Declare on this bus what `router` (and the routers it includes) declared: topics,
        publications and subscribers, with the routers' prefix, group and middlewares
        (`eventbus.router`). Raises what `topic`, `publishes` and `subscriber` raise for a bad
        declaration, and `ConfigError` when a router with middlewares adds a handler to a
        (topic, group) whose handlers are entered in other middlewares."""
        flat = router.flatten()
        for declared in flat.topics:
            self.topic(declared.topic, **declared.options)
        for pub in flat.publications:
            self.publishes(pub.topic, *pub.models)
        for sub, own in flat.subscribers:
            scope = self._scope
            if own:
                scope = self._router_scopes.get(own) or self._router_scopes.setdefault(
                    own, HandlerScope(self.state, self.publish, [*self._scope.middlewares, *own])
                )
            self._subscriber(sub.topic, sub.options, scope)(sub.handler)  # type: ignore[arg-type]

    def on_startup(self, hook: Hook) -> Hook:
        """Register ``async def hook()`` to run after connecting, before consumers start."""
        self._on_startup.append(hook)
        return hook

    def on_shutdown(self, hook: Hook) -> Hook:
        """Register ``async def hook()`` to run after consumers stopped, before disconnecting."""
        self._on_shutdown.append(hook)
        return hook

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
