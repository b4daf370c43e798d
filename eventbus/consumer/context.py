"""What a subscription is, and what a handler is told: `Subscription`, `RetryPolicy`,
`HandlerCall`, `Context`. Built once, at registration (`eventbus.consumer.registration`)."""

from __future__ import annotations

import asyncio
import inspect
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Unpack

import anyio.from_thread
import anyio.to_thread
import msgspec
from pydantic import BaseModel

from eventbus.consumer.scope import HandlerScope, State, chained_headers
from eventbus.errors import ConfigError, EventBusError
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.publisher import PublishOptions

if TYPE_CHECKING:
    from eventbus.consumer.options import SubscriberOptions
    from eventbus.consumer.routing import Routes

Handler = Callable[..., Any]  # async or sync; returns None, or a reply to a request


# A msgspec Struct, built per attempt: half the cost of a slotted dataclass (`stress/perf.py
# core`). The fields' order is API: the consumer builds it positionally (half the cost again).
class Context(msgspec.Struct):
    """What a handler knows about the entry it is processing.

    `fencing_token` grows on every change of the shard lock's owner: pass it to downstream stores
    that can reject writes carrying an older token (Kleppmann, "How to do distributed locking").
    `entry_id` is the Redis stream entry ID (``"<ms>-<seq>"``); `published_at_ms` the
    publisher's wall clock (Unix ms) when the event was created; `attempt` counts this process's
    handler attempts from 1; `delivery_count` counts the group's deliveries of the entry (from
    the pending entries list: 1 for a first delivery, more after a crash or a takeover).
    `scope` is what the bus's handlers share (`state`, `publish`; `eventbus.consumer.scope`).
    """

    topic: str
    group: str
    shard: int
    entry_id: str
    resource_id: str
    event_id_bytes: bytes
    event_type: str
    published_at_ms: int
    headers: dict[str, str]
    attempt: int
    fencing_token: int
    consumer_id: str
    delivery_count: int = 1
    scope: HandlerScope | None = None

    @property
    def redelivered(self) -> bool:
        """Whether the group delivered this entry before (to this or another consumer, e.g.
        one that crashed before acking it): the handler may have run on it already."""
        return self.delivery_count > 1

    @property
    def event_id(self) -> uuid.UUID:
        """The event's ID (UUID), set by the publisher: the key for idempotent handling."""
        return uuid.UUID(bytes=self.event_id_bytes)

    @property
    def state(self) -> State:
        """The bus's `State` (``bus.state``): what the service set up for its handlers."""
        if self.scope is None:
            raise EventBusError("this Context belongs to no bus: it has no state")
        return self.scope.state

    def publish(self, topic: str, event: BaseModel, **options: Unpack[PublishOptions]) -> Any:
        """`EventBus.publish` (``resource_id=``, ``headers=``) on the handler's bus, the new
        event carrying the handled one's correlation ID and, as causation ID, the handled
        event's ID (`eventbus.consumer.scope`; ``headers`` may set either).

        In an ``async def`` handler, await it: ``entry_id = await ctx.publish(...)``. In a
        plain ``def`` handler (run in a worker thread) call it: it publishes on the bus's event
        loop, waits, and returns the entry ID (``anyio.from_thread``). Raises what
        `EventBus.publish` raises, and `EventBusError` for a Context that belongs to no bus.
        """
        if self.scope is None or self.scope.publish is None:
            raise EventBusError("this Context belongs to no bus: it cannot publish")
        options["headers"] = chained_headers(
            self.headers, str(self.event_id), options.get("headers")
        )
        send = self.scope.publish(topic, event, **options)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: a sync handler's worker thread
            return anyio.from_thread.run(_awaited, send)
        return send  # on the loop: the caller awaits it


async def _awaited(coro: Awaitable[str]) -> str:
    return await coro


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failing handler is retried: `max_attempts` attempts in all, attempt n+1 waiting
    ``base_s * 2**(n-1)`` seconds (at most `max_s`), times a random factor in 0.5..1 ("equal
    jitter", as redis-py's `EqualJitterBackoff`), while the resource's later events wait."""

    max_attempts: int
    base_s: float
    max_s: float

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (from 1)."""
        return min(self.max_s, self.base_s * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class HandlerCall:
    """The user's handler, called the same way by the live consumer and by catch-up. Whether it
    is a coroutine function (awaited on the event loop) or a plain function (run in a worker
    thread) and whether it takes a `Context` are decided once, here. A plain function wrapping
    a coroutine function (a decorator with ``functools.wraps`` around ``def wrapper``) is called
    on the event loop, and whatever awaitable a handler returns is awaited: never acked unrun.
    A sync handler whose call is cancelled is abandoned: its thread runs to its end, unwaited.

    Raises `ConfigError` for a generator (sync or async) and for an event or context parameter
    that is keyword-only: such handlers registered, then failed every delivery."""

    __slots__ = ("direct", "func", "is_async", "name", "takes_context")

    def __init__(self, func: Handler, *, takes_context: bool) -> None:
        self.func = func
        self.takes_context = takes_context
        self.name: str = getattr(func, "__qualname__", repr(func))
        target = inspect.unwrap(func)
        if inspect.isasyncgenfunction(target) or inspect.isgeneratorfunction(target):
            raise ConfigError(
                f"handler {self.name} is a generator: a handler returns (None, or a reply to a "
                "request), it does not yield"
            )
        _check_positional(self.name, func, 2 if takes_context else 1)
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(target)
        self.direct = inspect.iscoroutinefunction(func)  # its call is a coroutine, always

    async def __call__(self, event: Any, ctx: Context) -> Any:
        """The handler's return value: None, or a reply to a request (`eventbus.request`)."""
        args = (event, ctx) if self.takes_context else (event,)
        if self.is_async:
            result = self.func(*args)
        else:
            # abandoned, not waited for, when cancelled (a timeout, shutdown): a thread cannot
            # be interrupted, and a hung one must not hold the consumer
            result = await anyio.to_thread.run_sync(
                partial(self.func, *args), abandon_on_cancel=True
            )
        while inspect.isawaitable(result):  # e.g. a sync wrapper's coroutine: run it too
            result = await result
        return result


def _check_positional(name: str, func: Callable[..., Any], n: int) -> None:
    """Raise `ConfigError` unless `func`'s first `n` parameters can be passed positionally."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin or an odd callable: its call will tell
        return
    for p in params[:n]:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            raise ConfigError(
                f"handler {name}: parameter {p.name!r} is keyword-only; the event (and the "
                "context) are passed by position"
            )


@dataclass(slots=True, kw_only=True)
class Subscription:
    """A (topic, group) and its handler(s), as registration leaves it (`eventbus.consumer.
    registration`): `options` is the group's one `SubscriberOptions` record (resolved against
    the settings; the consumer reads its options there: ``sub.options.ack``), `models` maps
    event type name -> pydantic model, `routes` gives each event type its handler
    (`eventbus.consumer.routing`) and `call` is the handler, or the `Router` of several.
    """

    topic: TopicConfig
    options: SubscriberOptions
    call: HandlerCall
    models: dict[str, type[BaseModel]]
    routes: Routes
    scope: HandlerScope = field(default_factory=HandlerScope)

    @property
    def group(self) -> str:
        """The consumer group (``options.group``): with the topic, what names the subscription
        in keys, logs and metrics."""
        return self.options.group

    @property
    def name(self) -> str:
        return self.call.name

    @property
    def handler(self) -> Handler:
        return self.call.func
