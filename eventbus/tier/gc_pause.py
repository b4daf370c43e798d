"""Python's cyclic garbage collector paused while a batch of replayed objects is made
(`paused_gc`: `eventbus.tier.archived`, `eventbus.tier.replay_events`,
`eventbus.tier.replay_columns`)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_gc_lock = threading.Lock()
_gc_pausers = 0  # threads making entries with the cyclic garbage collector paused
_gc_paused_by_us = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) while entries are made: a batch
    allocates a few tracked objects per row (UUIDs, ID tuples, column lists), whose
    collections took 40-45 % of a raw replay (flights, measured with ``gc.callbacks``); the
    objects form no cycles, reference counting frees them. Resumed when the last concurrent
    pauser ends, unless the application had disabled the collector itself (the pattern of
    `eventbus.consumer.decoding`'s large-entry decode, which tier code cannot import)."""
    global _gc_pausers, _gc_paused_by_us
    with _gc_lock:
        if _gc_pausers == 0 and gc.isenabled():
            gc.disable()
            _gc_paused_by_us = True
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_paused_by_us:
                _gc_paused_by_us = False
                gc.enable()
