"""The event loop eventbus runs its own ``anyio.run`` calls on (``eventbus run``, the CLI
commands, `SyncBus`'s loop thread): uvloop when it is installed (``pip install
eventbus[uvloop]``), asyncio's own loop otherwise or with ``EVENTBUS_UVLOOP=0``.

Applications that call ``anyio.run`` / ``asyncio.run`` themselves choose their loop: pass
``backend_options=eventbus.client.loops.backend_options()`` to ``anyio.run`` for the same choice.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def uvloop_enabled() -> bool:
    """Whether uvloop is installed and not turned off with ``EVENTBUS_UVLOOP=0``."""
    if os.environ.get("EVENTBUS_UVLOOP", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("uvloop") is not None


def backend_options() -> dict[str, Any]:
    """anyio's asyncio backend options: ``{"use_uvloop": True}`` when `uvloop_enabled`."""
    return {"use_uvloop": True} if uvloop_enabled() else {}


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(fn, *args)`` on asyncio, with uvloop when `uvloop_enabled`."""
    return anyio.run(fn, *args, backend="asyncio", backend_options=backend_options())


@contextlib.contextmanager
def young_gc_threshold(threshold: int) -> Iterator[None]:
    """Within the block, Python's cyclic garbage collector collects its youngest generation
    every `threshold` container allocations (`gc.set_threshold`; 0: unchanged); the previous
    thresholds come back after. The default 700 is tuned for small heaps: a consumer allocates
    a few containers per event (the entry's fields, envelope, event, context), so it collected
    every ~100 events, about a fifth of its CPU time."""
    if not threshold:
        yield
        return
    before = gc.get_threshold()
    gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
