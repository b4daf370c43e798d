"""`Router`: handlers, topics and publications declared in a module of their own, without the
bus, then added to it with `EventBus.include_router` (FastAPI's ``APIRouter`` and FastStream's
``RedisRouter`` are the model)::

    # billing/handlers.py: imports no bus
    router = Router(prefix="billing.", group="billing", middleware=[timed])

    @router.subscriber("orders")                 # topic "billing.orders", group "billing"
    async def bill(event: OrderPlaced, ctx: Context) -> None: ...

    router.publishes("invoices", Invoiced)       # topic "billing.invoices"

    # app.py
    bus = EventBus()
    bus.include_router(billing.handlers.router)

A router records its declarations; `EventBus.include_router` replays them on the bus, where they
are checked (a bad option is a `ConfigError` there) and become the bus's own: consumers,
``eventbus describe`` and the AsyncAPI document see them as if declared on the bus.

* `prefix` is put before every topic name the router declares (``subscriber``, ``publishes``,
  ``topic``); not before the topics a handler publishes to with ``ctx.publish`` (those are
  names as they are).
* `group` is the group of the router's subscribers that name none (not of broadcast ones).
* `middleware` (and `Router.middleware`) is entered around the router's handlers only, inside
  the bus's own middlewares (`eventbus.consumer.scope`). A (topic, group) takes one scope:
  a router with middleware cannot add handlers to a (topic, group) other handlers already have
  (`ConfigError` at `include_router`).
* A router may include routers (`Router.include_router`): their prefixes join (outer first),
  the inner group wins, middlewares nest (outer outermost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack

from pydantic import BaseModel

from eventbus.consumer.options import SubscriberArgs
from eventbus.consumer.scope import Middleware
from eventbus.errors import ConfigError

H = TypeVar("H", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Subscribed:
    """One ``@router.subscriber(topic, **options)``: `topic` without the prefix."""

    topic: str
    options: dict[str, Any]
    handler: Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Declared:
    """One ``router.topic(name, ...)`` (keyword arguments of `EventBus.topic`)."""

    topic: str
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Publishes:
    """One ``router.publishes(topic, *models)``."""

    topic: str
    models: tuple[type[BaseModel], ...]


@dataclass(frozen=True, slots=True)
class Flat:
    """A router's declarations with its and its includers' prefix, group and middlewares
    applied (`Router.flatten`): what `EventBus.include_router` declares on the bus."""

    topics: list[Declared]
    publications: list[Publishes]
    subscribers: list[tuple[Subscribed, tuple[Middleware, ...]]]


class Router:
    """Declarations to include in a bus later: see the module docstring.

    :param prefix: put before each topic name the router declares (e.g. ``"billing."``)
    :param group: the consumer group of its subscribers that give none (not broadcast ones)
    :param middleware: entered around each attempt of its handlers, inside the bus's
    :raises ConfigError: for a middleware that is not callable, or a prefix that is not a str
    """

    def __init__(
        self,
        *,
        prefix: str = "",
        group: str | None = None,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        if not isinstance(prefix, str):
            raise ConfigError(f"a router's prefix is a str, got {type(prefix).__name__}")
        self.prefix, self.group = prefix, group
        self.middlewares: list[Middleware] = []
        for mw in middleware:
            self.middleware(mw)
        self._topics: list[Declared] = []
        self._publications: list[Publishes] = []
        self._subscribers: list[Subscribed] = []
        self._routers: list[Router] = []

    def subscriber(self, topic: str, **options: Unpack[SubscriberArgs]) -> Callable[[H], H]:
        """Record the decorated function as a handler of `topic` (the prefix before it) with
        `options`, those of `EventBus.subscriber` (``group`` defaults to the router's). Checked
        when the router is included. Returns the function unchanged."""

        def register(handler: H) -> H:
            self._subscribers.append(Subscribed(topic, dict(options), handler))
            return handler

        return register

    def publishes(self, topic: str, *models: type[BaseModel]) -> None:
        """Record that the router's module publishes `models` on `topic` (the prefix before
        it): `EventBus.publishes` when included."""
        self._publications.append(Publishes(topic, models))

    def topic(self, name: str, **options: Any) -> None:
        """Record a topic declaration (the prefix before `name`; `shards`, `maxlen`,
        `retention` as for `EventBus.topic`), declared when the router is included."""
        self._topics.append(Declared(name, options))

    def middleware(self, mw: Middleware) -> Middleware:
        """Add ``mw(event, ctx)`` around the router's handlers (after those given before, so
        inside them); usable as a decorator. Raises `ConfigError` when `mw` is not callable."""
        if not callable(mw):
            raise ConfigError(f"a middleware must be callable, got {type(mw).__name__}")
        self.middlewares.append(mw)
        return mw

    def include_router(self, router: Router) -> None:
        """Include `router`'s declarations in this one (see the module docstring). Raises
        `ConfigError` when `router` is this router or includes it."""
        if router is self or self in router._all():
            raise ConfigError("a router cannot include itself")
        self._routers.append(router)

    def _all(self) -> list[Router]:
        out = []
        for r in self._routers:
            out += [r, *r._all()]
        return out

    def flatten(self) -> Flat:
        """The declarations of this router and those it includes, with prefixes, groups and
        middlewares applied (outer router first)."""
        topics, pubs = list(self._topics), list(self._publications)
        subs: list[tuple[Subscribed, tuple[Middleware, ...]]] = [(s, ()) for s in self._subscribers]
        for inner in self._routers:
            flat = inner.flatten()
            topics += flat.topics
            pubs += flat.publications
            subs += flat.subscribers
        mws = tuple(self.middlewares)
        return Flat(
            [Declared(self.prefix + t.topic, t.options) for t in topics],
            [Publishes(self.prefix + p.topic, p.models) for p in pubs],
            [
                (Subscribed(self.prefix + s.topic, self._grouped(s.options), s.handler), mws + m)
                for s, m in subs
            ],
        )

    def _grouped(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with this router's group where they name none (an inner router's group,
        applied first, wins; broadcast subscribers keep theirs)."""
        if options.get("group") is not None or options.get("broadcast") or self.group is None:
            return options
        return {**options, "group": self.group}


__all__ = ["Router"]
