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
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus

T = TypeVar("T")
log = logging.getLogger("eventbus")


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


_gc_lock = threading.Lock()
_gc_users = 0  # blocks of `young_gc_threshold` under way, in every thread
_gc_before: tuple[int, int, int] = (700, 10, 10)


@contextlib.contextmanager
def young_gc_threshold(threshold: int) -> Iterator[None]:
    """Within the block, Python's cyclic garbage collector collects its youngest generation
    every `threshold` container allocations (`gc.set_threshold`; 0: unchanged); the thresholds
    of before the first such block come back when the last one ends (blocks may overlap: a bus
    entered while its consumers run, two buses, `SyncBus`'s thread). Python's default, 700, is
    tuned for small heaps: a consumer allocates a few containers per event (the entry's fields,
    envelope, event, context) and a busy publisher holds a task per concurrent call, so it
    collected every ~100 events, up to a fifth of their CPU time (docs/performance.md)."""
    global _gc_users, _gc_before
    if not threshold:
        yield
        return
    with _gc_lock:
        if _gc_users == 0:
            _gc_before = gc.get_threshold()
            gc.set_threshold(threshold, *_gc_before[1:])
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0:
                gc.set_threshold(*_gc_before)


async def stop_on_signal(
    stop: anyio.Event, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Set `stop` at the first SIGTERM or SIGINT (logged), for a graceful shutdown, and go on
    handling both until the caller cancels this task (once its shutdown has ended: returns
    only by cancellation).

    While the shutdown runs, a further SIGTERM is logged and changes nothing: systemd's
    ``KillMode=control-group`` signals every process of the unit, and ``eventbus run
    --processes`` forwards the parent's SIGTERM too, so a child gets two (before, the second one
    met the default action and killed the child mid-handler). A second SIGINT (ctrl-C again)
    forces: logged, then `KeyboardInterrupt` is raised here, which cancels the running handlers
    (their entries stay pending; the locks free up after the liveness TTL).

    Reports `task_status.started()` (``await tg.start(stop_on_signal, stop)``) once the
    signals are caught. Raises `KeyboardInterrupt` on that second SIGINT, nothing else."""
    sigints = 0
    stopping = False
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGINT:
                sigints += 1
            if not stopping:
                stopping = True
                log.info("received %s: shutting down gracefully", name)
                stop.set()
            elif sigints >= 2:
                log.warning("received SIGINT again: forcing the shutdown (KeyboardInterrupt)")
                raise KeyboardInterrupt
            else:
                log.info(
                    "received %s again: already shutting down gracefully (a second SIGINT "
                    "forces, as SIGKILL does)",
                    name,
                )
