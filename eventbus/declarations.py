"""`Declarations`: what a service declares on its `EventBus` before it runs: topics, subscribers
(and their routers, `eventbus.router`), publications, middlewares and start-up/shutdown hooks.

Nothing here touches Redis: a declaration is checked when it is made (names, options, handler
signatures) and used when the bus starts (`eventbus.consumer.running`) or is described
(`eventbus.contract`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, Unpack

from pydantic import BaseModel

from eventbus.config import Settings
from eventbus.consumer import Handler, Subscription
from eventbus.consumer.options import SubscriberArgs, SubscriberOptions
from eventbus.consumer.registration import add_handler
from eventbus.consumer.scope import HandlerScope, Middleware, State
from eventbus.errors import ConfigError, ReservedEventType
from eventbus.lifecycle import Hook
from eventbus.profiles import WireProfile
from eventbus.protocol.codec import RESERVED_TYPE_PREFIX, event_type_of
from eventbus.protocol.keys import check_event_type
from eventbus.protocol.retention import Retention
from eventbus.protocol.topics import TopicConfig
from eventbus.router import Router

H = TypeVar("H", bound=Handler)


class Declarations:
    """The declaring part of `EventBus` (see the module docstring); its state is made by
    ``EventBus.__init__``."""

    settings: Settings
    profile: WireProfile
    state: State
    subscriptions: list[Subscription]
    publications: dict[str, list[type[BaseModel]]]
    _topics: dict[str, TopicConfig]
    _scope: HandlerScope
    _router_scopes: dict[tuple[Middleware, ...], HandlerScope]
    _on_startup: list[Hook]
    _on_shutdown: list[Hook]

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
            shards_from_settings=shards is None,
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

        if resolved.on_failure == "park" and not self.profile.codec.orders_by_resource:
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
                    own,
                    HandlerScope(self.state, self._scope.publish, [*self._scope.middlewares, *own]),
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
