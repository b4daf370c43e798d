"""Adding a handler to a bus's subscriptions: one `Subscription` per (topic, group), however
many handlers it routes to (`eventbus.consumer.routing`).

The options that shape the consumer (ack mode, retries, failure policy, de-duplication, timeout,
``on_unknown``) belong to the (topic, group): a handler may set one the others left unset (it
then applies to all), or repeat one; setting it to another value is a `ConfigError`, raised at
registration, so two modules cannot silently disagree on what their shared consumer does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from eventbus.consumer.batching import BatchHandlerCall
from eventbus.consumer.context import Subscription
from eventbus.consumer.routing import Raw, Router
from eventbus.errors import ConfigError

BROADCAST_PREFIX = "_broadcast"

# option -> (its value in a subscription, set it in a subscription)
_OPTIONS: dict[str, tuple[Callable[[Subscription], Any], Callable[[Subscription, Any], None]]] = {
    "ack": (lambda s: s.ack, lambda s, v: setattr(s, "ack", v)),
    "on_failure": (lambda s: s.on_failure, lambda s, v: setattr(s, "on_failure", v)),
    "dedup_window_s": (lambda s: s.dedup_window_s, lambda s, v: setattr(s, "dedup_window_s", v)),
    "handler_timeout_s": (
        lambda s: s.handler_timeout_s or 0,
        lambda s, v: setattr(s, "handler_timeout_s", v or None),
    ),
    "on_unknown": (lambda s: s.routes.on_unknown, lambda s, v: setattr(s.routes, "on_unknown", v)),
    "max_attempts": (
        lambda s: s.retry.max_attempts,
        lambda s, v: setattr(s, "retry", replace(s.retry, max_attempts=v)),
    ),
    "retry_base_s": (
        lambda s: s.retry.base_s,
        lambda s, v: setattr(s, "retry", replace(s.retry, base_s=v)),
    ),
    "retry_max_s": (
        lambda s: s.retry.max_s,
        lambda s, v: setattr(s, "retry", replace(s.retry, max_s=v)),
    ),
}


def broadcast_group(group: str | None) -> str:
    """The name a broadcast subscriber goes by (in logs, metrics and routing): not a Redis
    consumer group (`eventbus.consumer.broadcast`)."""
    return BROADCAST_PREFIX if group is None else f"{BROADCAST_PREFIX}.{group}"


def add_handler(
    subscriptions: list[Subscription],
    sub: Subscription,
    given: dict[str, Any],
    models: dict[str, type[BaseModel]],
    raw: Raw | None,
    type_names: Sequence[str] | None,
) -> None:
    """Route `sub`'s handler: as a new subscription, or into the one of its (topic, group),
    merging the options `given` explicitly (None: unset). Raises `ConfigError` for a
    conflicting option, an event type already routed, or a batch handler that is not alone."""
    given = {k: v for k, v in given.items() if v is not None}
    existing = next(
        (s for s in subscriptions if (s.topic.name, s.group) == (sub.topic.name, sub.group)),
        None,
    )
    if existing is None:
        sub.models.update(sub.routes.add(sub.call, models, raw, type_names))
        subscriptions.append(sub)
        sub.routes.options = given
        return
    where = f"topic {sub.topic.name!r}, group {sub.group!r}"
    if isinstance(existing.call, BatchHandlerCall) or isinstance(sub.call, BatchHandlerCall):
        raise ConfigError(f"{where}: a batch handler must be the only handler of its group")
    explicit = existing.routes.options
    for name, value in given.items():
        get, _ = _OPTIONS[name]
        ours = get(sub)
        if name in explicit and get(existing) != ours:
            raise ConfigError(
                f"{where}: {sub.call.name} sets {name}={value!r}, but another handler of the "
                f"group set {explicit[name]!r}; its handlers share one consumer and its options"
            )
    models_routed = existing.routes.add(sub.call, models, raw, type_names)
    for name, value in given.items():
        get, put = _OPTIONS[name]
        put(existing, get(sub))
        explicit[name] = value
    existing.models.update(models_routed)
    existing.call = Router(existing.routes)
