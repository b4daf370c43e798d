"""What a handler's signature declares: the event models it accepts (its first parameter's
annotation) and whether it takes a `Context`. Read once, when the handler is registered."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from eventbus.errors import ConfigError
from eventbus.protocol.codec import event_type_of


def handler_models(handler: Callable[..., Any]) -> tuple[dict[str, type[BaseModel]], bool]:
    """Event models accepted by `handler` (from its first parameter's annotation: a model or a
    union of models), by event type name, and whether it takes a second, `Context`, parameter.

    Raises `ConfigError` for a handler that takes other than one or two parameters, whose
    annotations do not resolve or are not models, or with two models of one event type.
    """
    params = list(inspect.signature(handler).parameters.values())
    if not params or len(params) > 2:
        raise ConfigError(f"handler {handler!r} must take (event) or (event, ctx)")
    try:
        hints = typing.get_type_hints(handler)
    except NameError as exc:  # a string annotation naming a class local to a function
        raise ConfigError(
            f"handler {handler!r}: cannot resolve its annotations ({exc}); define the event "
            "models at module level"
        ) from exc
    ann = hints.get(params[0].name)
    is_union = typing.get_origin(ann) in (typing.Union, types.UnionType)
    models = typing.get_args(ann) if is_union else (ann,)
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in models):
        raise ConfigError(
            f"handler {handler!r}: annotate its first parameter with a pydantic model "
            f"or a union of models, not {ann!r}"
        )
    by_type: dict[str, type[BaseModel]] = {}
    for m in models:
        name = event_type_of(m)
        if name in by_type:
            raise ConfigError(f"handler {handler!r}: two models share the event type {name!r}")
        by_type[name] = m
    return by_type, len(params) == 2


def handler_input(
    handler: Callable[..., Any],
) -> tuple[dict[str, type[BaseModel]], type[dict[str, Any]] | type[bytes] | None, bool]:
    """Like `handler_models`, and also accepting a first parameter typed ``dict`` (the payload
    as a plain dict) or ``bytes`` (the payload as MessagePack): returns (models by event type
    name, `dict` or `bytes` or None, whether it takes a `Context`). Raises `ConfigError` like
    `handler_models`."""
    params = list(inspect.signature(handler).parameters.values())
    if params and len(params) <= 2:
        try:
            ann = typing.get_type_hints(handler).get(params[0].name)
        except NameError:
            ann = None  # handler_models says why
        base = typing.get_origin(ann) or ann
        if base is dict:
            return {}, dict, len(params) == 2
        if base is bytes:
            return {}, bytes, len(params) == 2
    models, takes_ctx = handler_models(handler)
    return models, None, takes_ctx
