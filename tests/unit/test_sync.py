"""`SyncBus`'s methods are `EventBus`'s, blocking: the same parameters, defaults and results."""

from __future__ import annotations

import inspect

import pytest

from eventbus import EventBus
from eventbus.sync import SyncBus


@pytest.mark.parametrize("name", ["publish", "publish_many", "request"])
def test_sync_bus_methods_take_the_bus_methods_arguments(name: str) -> None:
    ours = inspect.signature(getattr(SyncBus, name))
    theirs = inspect.signature(getattr(EventBus, name))
    assert list(ours.parameters.values()) == list(theirs.parameters.values())
    assert ours.return_annotation == theirs.return_annotation
