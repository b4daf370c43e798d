"""Adding a handler to a bus's subscriptions: one `Subscription` per (topic, group), however
many handlers it routes to (`eventbus.consumer.routing`).

The handler's signature is read once, here (`eventbus.consumer.signature`, or the batch form of
`eventbus.consumer.batching`), into the `HandlerCall` the consumer and catch-up call. The options
that shape the consumer belong to the (topic, group) (`SubscriberOptions.merge`): two handlers
that set one to different values are a `ConfigError`, raised at registration, so two modules
cannot silently disagree on what their shared consumer does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventbus.consumer.batching import BatchHandlerCall, batch_handler_models
from eventbus.consumer.context import HandlerCall, Subscription
from eventbus.consumer.depends import with_dependencies
from eventbus.consumer.options import SubscriberOptions
from eventbus.consumer.routing import Raw, Router, Routes
from eventbus.consumer.scope import HandlerScope
from eventbus.consumer.signature import handler_input
from eventbus.errors import ConfigError, ReservedEventType
from eventbus.protocol.codec import RESERVED_TYPE_PREFIX
from eventbus.protocol.keys import check_event_type
from eventbus.protocol.topics import TopicConfig


def add_handler(
    subscriptions: list[Subscription],
    topic: TopicConfig,
    options: SubscriberOptions,
    handler: Callable[..., Any],
    scope: HandlerScope | None = None,
) -> None:
    """Route `handler` (registered on `topic` with `options`): as a new subscription, or into
    the one of its (topic, group), whose options then apply the ones it set explicitly. A new
    subscription shares `scope`, the bus's (`eventbus.consumer.scope`; default: its own).

    Raises `ConfigError` for a handler signature that does not fit, a conflicting option, an
    event type already routed, or a batch handler that is not alone in its group;
    `ReservedEventType` for a type starting with ``__eventbus.``, `InvalidEventType` for a type
    name that is not 1-200 characters of ``[A-Za-z0-9_.-]``.
    """
    raw: Raw | None = None
    if options.batch:
        models, takes_ctx = batch_handler_models(handler)
        call: HandlerCall = BatchHandlerCall(
            handler, takes_context=takes_ctx, max_batch=options.max_batch
        )
    else:
        handler = with_dependencies(handler)  # itself when it has none
        models, raw, takes_ctx = handler_input(handler)
        call = HandlerCall(handler, takes_context=takes_ctx)
    where = f"topic {topic.name!r}, group {options.group!r}"
    for name in [*models, *options.type_names]:
        if name.startswith(RESERVED_TYPE_PREFIX):
            raise ReservedEventType(name, f"subscriber of {where}")
        check_event_type(name, f"subscriber of {where}")
    key = (topic.name, options.group)
    existing = next((s for s in subscriptions if (s.topic.name, s.group) == key), None)
    if existing is None:
        routes = Routes()
        routed = routes.add(call, models, raw, options.type_names)
        subscriptions.append(
            Subscription(
                topic=topic,
                options=options,
                call=call,
                models=routed,
                routes=routes,
                scope=scope or HandlerScope(),
            )
        )
        return
    if isinstance(existing.call, BatchHandlerCall) or isinstance(call, BatchHandlerCall):
        raise ConfigError(f"{where}: a batch handler must be the only handler of its group")
    merged = existing.options.merge(options, f"{where}: {call.name}")  # raises before routing
    existing.models.update(existing.routes.add(call, models, raw, options.type_names))
    existing.options = merged
    existing.call = Router(existing.routes)
