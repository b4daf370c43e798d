"""Handler timeouts at no cost per attempt: one watchdog per consumer instead of a cancel scope
per handler call.

A cancel scope with a deadline costs 6-12 us per call on asyncio (a timer scheduled and
cancelled, task lookups): about 40 % of the per-event path when every attempt had one
(docs/performance.md). Here each worker task owns a `Slot`; an attempt only writes its start
time into it (`Slot.started`, monotonic seconds) and clears it after. The `Watchdog` task sleeps
until the earliest deadline of the attempts in flight (no attempt can fall due sooner than
`timeout_s` after the watchdog last looked) and cancels the worker task of an overdue attempt
with ``Task.cancel()``; the attempt turns that `CancelledError` into `HandlerTimeout` and
``Task.uncancel()``s it, as ``asyncio.timeout`` does (Python docs, "Task Cancellation"). A
timeout is enforced within the event loop's scheduling delay of its deadline.

asyncio only, like the rest of eventbus (``anyio.run`` with the asyncio backend, or uvloop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel


class Slot:
    """The attempt a worker task is running: `started` is its start (monotonic s), 0 when the
    worker is not inside a handler call; `fired` is set by the watchdog when it cancelled it."""

    __slots__ = ("fired", "started", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.started = 0.0
        self.fired = False

    def timed_out(self) -> bool:
        """Call after an attempt, whatever its outcome, before `started` is cleared: whether the
        watchdog cancelled it. Undoes that cancellation's count on the task (``uncancel``), so
        that an enclosing scope does not take it for its own."""
        if not self.fired:
            return False
        self.fired = False
        self.task.uncancel()
        return True


class Watchdog:
    """Cancels handler attempts that run longer than `timeout_s` seconds (None: never)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._slots: dict[asyncio.Task[object], Slot] = {}

    def running(self) -> int:
        """How many worker tasks are inside a handler call now."""
        return sum(1 for slot in self._slots.values() if slot.started)

    def slot(self) -> Slot:
        """The calling task's slot (made on its first attempt; dropped once the task is done)."""
        task = asyncio.current_task()
        slot = self._slots.get(task)  # type: ignore[arg-type]
        if slot is None:
            assert task is not None
            slot = self._slots[task] = Slot(task)
        return slot

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Watch while the block runs (for callers without a task group of their own, e.g. a
        standalone catch-up); the block's exception propagates as it is, not in a group."""
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.run)
            try:
                yield
            except BaseException as exc:  # re-raised below, outside the task group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error

    async def run(self) -> None:
        """Watch until cancelled (a task of the consumer's task group)."""
        timeout = self.timeout_s
        if timeout is None:
            return
        while True:
            now = time.monotonic()
            for task in [t for t in self._slots if t.done()]:
                del self._slots[task]
            running = [s.started for s in self._slots.values() if s.started and not s.fired]
            due = min(running, default=now) + timeout
            if due > now:
                await anyio.sleep(due - now)
                continue
            for s in self._slots.values():
                if s.started and not s.fired and now - s.started >= timeout:
                    s.fired = True
                    s.task.cancel()
            await anyio.lowlevel.checkpoint()
