"""The contract of an application, read from its `EventBus`: what ``eventbus describe`` prints
and `eventbus.asyncapi` writes as an AsyncAPI 3.0 document.

`contract_of(bus)` collects, from the registered subscribers and the ``bus.publishes(...)``
declarations: every topic (shards, ``MAXLEN ~`` cap, retention), every consumer group with its
handlers, the event types each handler takes (a pydantic model, or a raw ``dict``/``bytes``
payload), its delivery and failure policy (ack mode, attempts and backoff, ``on_failure``,
``on_unknown``, de-duplication, timeout, batching), and the event types each topic is declared
to receive from this module. Nothing here talks to Redis: the contract is the code's.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from eventbus.consumer.batch_call import BatchHandlerCall
from eventbus.consumer.context import HandlerCall, RetryPolicy
from eventbus.errors import ConfigError
from eventbus.protocol.codec import event_type_of
from eventbus.protocol.topics import TopicConfig

if TYPE_CHECKING:
    from eventbus.app import EventBus

Raw = Literal["dict", "bytes"]


@dataclass(frozen=True, slots=True)
class HandlerContract:
    """One handler: `name` is ``module:qualname``; `events` maps each event type it takes to its
    model (None for a ``dict``/``bytes`` handler's types); `catch_all` when it takes every type
    no other handler of its group takes (`raw` says how it receives them)."""

    name: str
    events: dict[str, type[BaseModel] | None]
    catch_all: bool = False
    raw: Raw | None = None
    replies: tuple[type[BaseModel], ...] = ()
    """The models its return annotation names: its answers to requests (`eventbus.request`;
    a batch handler's ``list[...]`` items)."""

    @property
    def takes_raw(self) -> bool:
        """Whether it takes some event types as raw payloads, not validated by a model."""
        return self.catch_all or any(m is None for m in self.events.values())


@dataclass(frozen=True, slots=True)
class GroupContract:
    """A (topic, group) and its handlers, with the policies they share (`EventBus.subscriber`
    documents each: seconds for every ``_s`` value, None for a limit that is off)."""

    topic: TopicConfig
    group: str
    handlers: list[HandlerContract]
    broadcast: bool
    ack: Literal["after", "before"]
    retry: RetryPolicy
    on_failure: Literal["continue", "park"]
    on_unknown: str
    dedup_window_s: float | None
    handler_timeout_s: float | None
    max_batch: int | None  # None: one event per call

    @property
    def event_types(self) -> list[str]:
        return [t for h in self.handlers for t in h.events]


@dataclass(frozen=True, slots=True)
class Contract:
    """What an application consumes (`groups`) and declares it publishes (`publishes`: topic ->
    models), over `topics`."""

    topics: dict[str, TopicConfig]
    groups: list[GroupContract]
    publishes: dict[str, list[type[BaseModel]]] = field(default_factory=dict)

    def models(self, topic: str) -> dict[str, type[BaseModel]]:
        """Event type -> model of every model the contract names on `topic`."""
        found = {event_type_of(m): m for m in self.publishes.get(topic, [])}
        for g in self.groups:
            if g.topic.name == topic:
                for h in g.handlers:
                    found.update({t: m for t, m in h.events.items() if m is not None})
        return found

    def takes_raw(self, topic: str) -> bool:
        """Whether some handler on `topic` takes raw payloads (``dict``/``bytes``)."""
        return any(h.takes_raw for g in self.groups if g.topic.name == topic for h in g.handlers)


def contract_of(bus: EventBus) -> Contract:
    """The contract of `bus`'s subscribers and publisher declarations."""
    topics: dict[str, TopicConfig] = {}
    groups = []
    for sub in bus.subscriptions:
        topics[sub.topic.name] = sub.topic
        handlers: dict[HandlerCall, HandlerContract] = {}
        routes = sub.routes
        for event_type, route in routes.by_type.items():
            h = handlers.get(route.call) or _handler(route.call, route.model)
            h.events[event_type] = route.model
            handlers[route.call] = h
        if routes.fallback is not None:
            call = routes.fallback.call
            base = handlers.get(call) or _handler(call, None)
            handlers[call] = HandlerContract(
                base.name, base.events, True, _raw(call), _replies(call)
            )
        batch = sub.call if isinstance(sub.call, BatchHandlerCall) else None
        groups.append(
            GroupContract(
                topic=sub.topic,
                group=sub.group,
                handlers=list(handlers.values()),
                broadcast=sub.options.broadcast,
                ack=sub.options.ack,
                retry=sub.options.retry,
                on_failure=sub.options.on_failure,
                on_unknown=sub.options.on_unknown,
                dedup_window_s=sub.options.dedup_window_s,
                handler_timeout_s=sub.options.handler_timeout_s,
                max_batch=batch.max_batch if batch is not None else None,
            )
        )
    publishes = {name: list(models) for name, models in bus.publications.items()}
    for name in publishes:
        topics[name] = bus.topic(name)
    return Contract(dict(sorted(topics.items())), groups, publishes)


def _handler(call: HandlerCall, model: type[BaseModel] | None) -> HandlerContract:
    func = call.func
    name = f"{getattr(func, '__module__', '?')}:{call.name}"
    return HandlerContract(
        name, {}, raw=None if model is not None else _raw(call), replies=_replies(call)
    )


def _replies(call: HandlerCall) -> tuple[type[BaseModel], ...]:
    """The pydantic models in `call`'s return annotation (through ``X | None``, unions and, for
    a batch handler, ``list[...]``), in annotation order; none when it has no annotation or
    one that cannot be resolved."""
    try:
        ann = typing.get_type_hints(call.func).get("return")
    except Exception:  # an annotation naming what cannot be imported: the handler says so
        return ()
    found: list[type[BaseModel]] = []

    def visit(t: object) -> None:
        if isinstance(t, type) and issubclass(t, BaseModel):
            found.append(t)
        else:
            for arg in typing.get_args(t):
                visit(arg)

    visit(ann)
    return tuple(dict.fromkeys(found))


def _raw(call: HandlerCall) -> Raw | None:
    """How a handler without a model receives its payload, from its first parameter's type."""
    from eventbus.consumer.signature import handler_input

    try:
        _, raw, _ = handler_input(call.func)
    except ConfigError:  # a batch handler's list[...] signature: its models say enough
        return None
    if raw is None:
        return None
    return "bytes" if raw is bytes else "dict"
