"""`SyncBus`: the bus for synchronous code (Flask, Django), made by `EventBus.sync()`.

The bus runs on a private event loop thread (an anyio blocking portal); each `SyncBus` method is
the `EventBus` coroutine of the same name, blocking the calling thread until it is done there.
Calls from many threads are coalesced into pipelines like async ones.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import anyio.from_thread

if TYPE_CHECKING:
    from eventbus.app import EventBus

P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    portal: anyio.from_thread.BlockingPortal, fn: Callable[P, Awaitable[T]]
) -> Callable[P, T]:
    """`fn` as a blocking call that runs on `portal`'s event loop (same signature and doc)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        return portal.call(functools.partial(fn, *args, **kwargs))

    return call


class SyncBus:
    """Blocking publishing API for synchronous code; made by `EventBus.sync()`.

    ``publish(topic, event, *, resource_id, headers=None)`` is `EventBus.publish`, blocking the
    calling thread until Redis confirms; it is thread-safe.
    """

    def __init__(self, bus: EventBus, portal: anyio.from_thread.BlockingPortal) -> None:
        self._bus = bus
        self._portal = portal
        self.publish = _blocking(portal, bus.publish)
