"""Every eventbus error survives pickling (a process pool, or a task queue's result backend,
sends it back to its caller): same class, message and attributes."""

from __future__ import annotations

import inspect
import pickle
import typing
from typing import Any

import pytest

import eventbus.errors
import eventbus.tier.completeness
import eventbus.tier.errors
from eventbus.errors import EventBusError

_SAMPLES: dict[Any, Any] = {str: "orders", int: 7, float: 2.5, bool: True, object: "x"}


def _errors() -> list[type[EventBusError]]:
    found: set[type[EventBusError]] = set()
    for module in (eventbus.errors, eventbus.tier.errors, eventbus.tier.completeness):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, EventBusError):
                found.add(cls)
    return sorted(found, key=lambda c: c.__qualname__)


def _sample(annotation: Any) -> Any:
    if annotation in _SAMPLES:
        return _SAMPLES[annotation]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return [_sample(args[0])]
    return _sample(args[0])  # X | None: an X


def _instance(cls: type[EventBusError]) -> EventBusError:
    """`cls` built with a sample value for each argument of its ``__init__``."""
    if cls.__init__ is BaseException.__init__:
        return cls("something went wrong")
    hints = typing.get_type_hints(cls.__init__, vars(inspect.getmodule(cls)))
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    pos = [_sample(hints[p.name]) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    kw = {p.name: _sample(hints[p.name]) for p in params if p.kind is p.KEYWORD_ONLY}
    return cls(*pos, **kw)


@pytest.mark.parametrize("cls", _errors(), ids=lambda c: c.__name__)
def test_an_error_pickles_with_its_message_and_attributes(cls: type[EventBusError]) -> None:
    err = _instance(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args
    assert back.__dict__ == err.__dict__
