"""What a batch handler is: `BatchHandlerCall` (how it is called) and `batch_handler_models`
(what its signature declares), decided once at registration (`EventBus.subscriber` with
``batch=True``). The batches themselves: `eventbus.consumer.batching`."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeGuard, cast

import anyio.to_thread
from pydantic import BaseModel

from eventbus.consumer.context import Context, Handler, HandlerCall
from eventbus.errors import ConfigError
from eventbus.protocol.codec import event_type_of


class BatchHandlerCall(HandlerCall):
    """A batch handler: `call_batch(events, ctxs)`; called with one event (the per-event path:
    replays of parked letters, the last step of a split) it gets lists of one."""

    __slots__ = ("max_batch",)

    def __init__(self, func: Handler, *, takes_context: bool, max_batch: int) -> None:
        super().__init__(func, takes_context=takes_context)
        self.max_batch = max_batch

    async def call_batch(self, events: list[Any], ctxs: list[Context]) -> Any:
        """The handler's return value: None, or a list of one answer per event, in order
        (None for an event it does not answer; a model answers a request, `batching`)."""
        args = (events, ctxs) if self.takes_context else (events,)
        if self.is_async:
            return await cast("Awaitable[Any]", self.func(*args))
        return await anyio.to_thread.run_sync(partial(self.func, *args), abandon_on_cancel=True)

    async def __call__(self, event: Any, ctx: Context) -> Any:
        """The batch of one's answer (its list's one item), or what the handler returned when
        it is not a list of one (the per-event path then refuses it for a request)."""
        result = await self.call_batch([event], [ctx])
        if isinstance(result, list) and len(result) == 1:
            return result[0]
        return result


def batch_handler_models(handler: Callable[..., Any]) -> tuple[dict[str, type[BaseModel]], bool]:
    """Event models of a batch handler ``(events: list[Model], ctxs: list[Context])`` by event
    type, and whether it takes the contexts. Raises `ConfigError` for another shape."""
    params = list(inspect.signature(handler).parameters.values())
    if not params or len(params) > 2:
        raise ConfigError(f"batch handler {handler!r} must take (events) or (events, ctxs)")
    try:
        ann = typing.get_type_hints(handler).get(params[0].name)
    except NameError as exc:
        raise ConfigError(f"batch handler {handler!r}: cannot resolve its annotations") from exc
    if typing.get_origin(ann) is not list:
        raise ConfigError(f"batch handler {handler!r}: annotate events as list[Model], not {ann}")
    (inner,) = typing.get_args(ann)
    is_union = typing.get_origin(inner) in (typing.Union, types.UnionType)
    models = typing.get_args(inner) if is_union else (inner,)
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in models):
        raise ConfigError(f"batch handler {handler!r}: list[...] must hold pydantic models")
    by_type = {event_type_of(m): m for m in models}
    if len(by_type) != len(models):
        raise ConfigError(f"batch handler {handler!r}: two models share an event type")
    return by_type, len(params) == 2


def is_batch(call: HandlerCall) -> TypeGuard[BatchHandlerCall]:
    return isinstance(call, BatchHandlerCall)
