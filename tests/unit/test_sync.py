"""`SyncBus`'s methods are `EventBus`'s, blocking, and `Context.publish` is `EventBus.publish`:
the same parameters and results (`Context.publish`'s result: awaitable in an ``async def``
handler, the entry ID in a ``def`` one's worker thread). The wrappers take the keyword arguments
as one record (``**options: Unpack[PublishOptions]``, PEP 692) and pass them on, so the defaults
live in `EventBus` alone; these tests check that the record lists exactly `EventBus`'s keywords."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, NotRequired, Unpack

import pytest
from pydantic import BaseModel

from eventbus import EventBus
from eventbus.consumer.context import Context
from eventbus.publishing.publisher import PublishOptions
from eventbus.sync import SyncBus

Param = tuple[str, Any, Any, bool]  # name, kind, type, required


def _parameters(func: Callable[..., Any]) -> tuple[list[Param], dict[str, Param], Any]:
    """`func`'s positional parameters (but ``self``) in order, its keyword-only ones by name,
    with ``**options: Unpack[TD]`` expanded into TD's keys, and its return type."""
    hints = typing.get_type_hints(func)
    positional: list[Param] = []
    keywords: dict[str, Param] = {}
    for p in list(inspect.signature(func).parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            (record,) = typing.get_args(hints[p.name])  # Unpack[TD]
            for key, hint in typing.get_type_hints(record, include_extras=True).items():
                optional = typing.get_origin(hint) is NotRequired  # (3.11: not __optional_keys__)
                value = typing.get_args(hint)[0] if optional else hint
                keywords[key] = (key, p.KEYWORD_ONLY, value, not optional)
        else:
            param = (p.name, p.kind, hints[p.name], p.default is p.empty)
            if p.kind is p.KEYWORD_ONLY:
                keywords[p.name] = param
            else:
                positional.append(param)
    return positional, keywords, hints["return"]


@pytest.mark.parametrize(
    ("wrapper", "name"),
    [(SyncBus, "publish"), (SyncBus, "publish_many"), (SyncBus, "request"), (Context, "publish")],
)
def test_wrappers_take_the_bus_methods_arguments(wrapper: type, name: str) -> None:
    ours = _parameters(getattr(wrapper, name))
    theirs = _parameters(getattr(EventBus, name))
    if wrapper is Context:  # awaited in an async handler, the entry ID in a sync one's thread
        assert ours[:2] == theirs[:2] and ours[2] is Any
        return
    assert ours == theirs


class _Wider(PublishOptions):
    ttl_s: NotRequired[float]


def _wider_publish(self: object, topic: str, event: BaseModel, **options: Unpack[_Wider]) -> str:
    raise NotImplementedError


def _narrower_publish(self: object, topic: str, event: BaseModel, *, resource_id: str) -> str:
    raise NotImplementedError


@pytest.mark.parametrize("wrapper", [_wider_publish, _narrower_publish])
def test_the_check_tells_a_keyword_too_many_or_missing(wrapper: Callable[..., Any]) -> None:
    assert _parameters(wrapper) != _parameters(EventBus.publish)
