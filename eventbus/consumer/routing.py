"""Which handler of a (topic, group) takes an entry, by its event type: `Routes`, `Router`.

Several handlers may subscribe to one (topic, group): they share its consumer, its shard locks
and its per-resource queues, so a resource's events run one after another in stream order,
whatever their types. Each event type goes to one handler:

* a handler typed with a model (or a union of models) takes the models' event types
  (`eventbus.protocol.codec.event_type_of`: ``__event_type__`` or the class name), or the names
  given as ``type_name=`` (one model: aliases, e.g. a type's old name while producers migrate);
* a handler typed ``dict`` (the payload as a plain dict, not validated) or ``bytes`` (the
  payload as MessagePack bytes) takes the types named by ``type_name=``, or without one every
  type no other handler takes (at most one such catch-all per (topic, group)).

An entry of a type no handler takes is *unknown*: per (topic, group), ``on_unknown``
(`SubscriberOptions.on_unknown`) decides whether it is dead-lettered (``"dead_letter"``, the
default, as `UnknownEventType`) or skipped (``"skip"``: acked unhandled, counted in
``eventbus_skipped_unknown_total``, a WARNING logged the first time each type is skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from eventbus.consumer.context import Context, HandlerCall
from eventbus.errors import ConfigError, DecodeError

Raw = type[dict[str, Any]] | type[bytes]


@dataclass(frozen=True, slots=True)
class Route:
    """One handler for one event type: `convert` makes its argument from the payload (raises
    `DecodeError`); `model` is the pydantic model it validates (None for dict/bytes payloads),
    so that a read's payloads of one model are validated in one call (`Handling.prepare`)."""

    call: HandlerCall
    convert: Callable[[Any], Any]
    model: type[BaseModel] | None = None


def _model(model: type[BaseModel]) -> Callable[[Any], Any]:
    def convert(payload: Any) -> Any:
        try:
            return model.model_validate(payload)
        except ValidationError as exc:
            raise DecodeError(f"payload does not validate as {model.__name__}: {exc}") from None
        except Exception as exc:  # a validator of the model raised something else
            raise DecodeError(
                f"payload does not validate as {model.__name__}: {type(exc).__name__}: {exc}"
            ) from None

    return convert


def _as_dict(payload: Any) -> Any:
    if not isinstance(payload, dict):
        raise DecodeError(f"payload is a {type(payload).__name__}, not a map")
    return payload


def _as_bytes(payload: Any) -> bytes:
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


class Routes:
    """The routes of one (topic, group): event type -> `Route`, and an optional catch-all."""

    def __init__(self) -> None:
        self.by_type: dict[str, Route] = {}
        self.fallback: Route | None = None
        self.calls: list[HandlerCall] = []

    def get(self, event_type: str) -> Route | None:
        return self.by_type.get(event_type, self.fallback)

    def expects(self) -> str:
        """The types taken, for error messages."""
        names = sorted(self.by_type)
        return f"{names} and any other" if self.fallback is not None else str(names)

    def add(
        self,
        call: HandlerCall,
        models: dict[str, type[BaseModel]],
        raw: Raw | None,
        type_names: Sequence[str] | None,
    ) -> dict[str, type[BaseModel]]:
        """Route `call`'s types: its `models` (by type name), or `raw` (dict or bytes)
        payloads. Returns the models by the type names they are routed under. Raises
        `ConfigError` for a type already routed, a second catch-all, or `type_names` given
        with a union of models."""
        routes: dict[str, Route] = {}
        routed: dict[str, type[BaseModel]] = {}
        if raw is not None:
            convert = _as_dict if raw is dict else _as_bytes
            if not type_names:
                if self.fallback is not None:
                    raise ConfigError(
                        f"{call.name}: {self.fallback.call.name} already takes every other "
                        "event type (a dict/bytes handler without type_name)"
                    )
                self.fallback = Route(call, convert)
            routes = {t: Route(call, convert) for t in type_names or ()}
        elif type_names:
            if len(models) != 1:
                raise ConfigError(f"{call.name}: type_name needs a handler of one model")
            (model,) = models.values()
            routed = dict.fromkeys(type_names, model)
        else:
            routed = dict(models)
        routes |= {t: Route(call, _model(m), m) for t, m in routed.items()}
        for t in routes:
            if t in self.by_type:
                raise ConfigError(
                    f"{call.name}: event type {t!r} is already handled by "
                    f"{self.by_type[t].call.name}"
                )
        self.by_type.update(routes)
        self.calls.append(call)
        return routed


class Router(HandlerCall):
    """The `HandlerCall` of a (topic, group) with several handlers: calls the one its entry's
    type is routed to (`Context.event_type`)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self.func = self
        self.takes_context = True
        self.is_async = all(c.is_async for c in routes.calls)
        self.name = " | ".join(c.name for c in routes.calls)

    async def __call__(self, event: Any, ctx: Context) -> Any:
        route = self.routes.get(ctx.event_type)
        assert route is not None  # decoding found it
        return await route.call(event, ctx)  # a reply to a request, or None
