"""The ordered queue of one publisher's calls: `Slot` (one call's place) and `SlotQueue`.

Every `publish()` takes a `Slot` the moment it is called, before anything that can wait (the
topic's shard-count check), and marks it ready once its entry is encoded; the flusher
(`eventbus.publishing.sending`) takes the longest ready prefix as its next batch, so entries
leave in call order. Unconfirmed batches go back to the front, in order. Each slot has a
deadline (`publish_timeout_s`): one that passes while the slot waits fails it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import anyio
import msgspec

from eventbus.config import Settings
from eventbus.errors import PublishError
from eventbus.ops.metrics import METRICS


class Slot(msgspec.Struct, eq=False):
    """One publish's place in the queue; `stream` is None until its entry is encoded (ready).
    `deadline` (monotonic seconds) is set when the slot is first sent: it fails with
    `PublishError` if not confirmed by then. `queued`: taken while the flusher ran (it sends
    the slot); else its caller sends it (`submit`), also if the flusher started meanwhile.
    A `msgspec.Struct` (one per call): its constructor runs in C, a dataclass's in Python."""

    future: asyncio.Future[str]
    stream: str | None = None
    fields: dict[bytes, bytes] | None = None
    maxlen: int = 0
    deadline: float = math.inf
    queued: bool = False

    def settle(self, result: Any) -> None:
        if self.future.done():  # the caller was cancelled (its deadline passed)
            return
        if isinstance(result, Exception):
            METRICS.publish_errors.inc()
            if not isinstance(result, PublishError):
                result = PublishError(f"XADD {self.stream} failed: {result}")
            self.future.set_exception(result)
        else:
            self.future.set_result(result.decode() if isinstance(result, bytes) else result)


class SlotQueue:
    """The slots of one publisher, in call order; `wake` tells the flusher that it may have a
    batch to take (set by `ready` only while the flusher is `idle`, and by `withdraw`)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._slots: deque[Slot] = deque()
        self.wake = anyio.Event()
        self.idle = False  # the flusher waits on `wake` (`ready` wakes it only then)
        self.running = False  # a flusher sends the queue (else each caller sends its own)
        self.loop: asyncio.AbstractEventLoop | None = None  # the flusher's, while it runs

    def reserve(self, timeout_s: float | None = None) -> Slot:
        """A new slot at the end of the queue: call it before the caller's first await. With
        `timeout_s` its deadline runs from now (`publish()`: a deadline on the caller), else from
        when it is first sent (`publish_many`: one pipeline's worth of time per batch)."""
        loop = self.loop if self.running else None
        slot = Slot((loop or asyncio.get_running_loop()).create_future())
        if timeout_s is not None:
            slot.deadline = time.monotonic() + timeout_s
        if self.running:  # without a flusher each call is sent on its own (`submit`)
            slot.queued = True
            self._slots.append(slot)
        return slot

    def reserve_many(self, count: int) -> list[Slot]:
        """`count` new slots at the end of the queue, in order, their deadlines running from
        when each is first sent (`publish_many`); as `reserve()` `count` times, in one pass."""
        loop = (self.loop if self.running else None) or asyncio.get_running_loop()
        slots = [Slot(loop.create_future()) for _ in range(count)]
        if self.running:
            for slot in slots:
                slot.queued = True
            self._slots.extend(slots)
        return slots

    def ready(self, slot: Slot, stream: str, fields: dict[bytes, bytes], maxlen: int) -> None:
        """Mark `slot` ready: its entry, encoded, goes to `stream` capped at `maxlen`."""
        slot.stream, slot.fields, slot.maxlen = stream, fields, maxlen
        if self.idle:  # the flusher waits for work (else its next batch takes this slot)
            self.idle = False  # woken once: the calls ready before it runs need not set it
            self.wake.set()

    def withdraw(self, slot: Slot) -> None:
        """Take a slot that was never made ready out of the queue (its caller failed first)."""
        if slot.stream is None:
            with contextlib.suppress(ValueError):
                self._slots.remove(slot)
            self.wake.set()  # the slot may have held back the ones behind it

    def take(self) -> list[Slot]:
        """The ready prefix of the queue, up to `publish_batch_max` slots, their deadlines
        started if not yet (in the same pass); cancelled callers' slots are dropped."""
        batch: list[Slot] = []
        queue = self._slots
        now = time.monotonic()
        start_deadline = now + self._settings.publish_timeout_s
        room = self._settings.publish_batch_max
        while queue and room:
            head = queue[0]
            if head.future.done():
                queue.popleft()
            elif head.stream is None:
                break
            elif head.deadline <= now:  # waited its whole deadline in the queue
                queue.popleft().settle(self.timed_out(TimeoutError("not sent in time")))
            else:
                if head.deadline == math.inf:
                    head.deadline = start_deadline
                batch.append(queue.popleft())
                room -= 1
        return batch

    def timed_out(self, error: BaseException) -> PublishError:
        return PublishError(
            f"XADD not confirmed within {self._settings.publish_timeout_s:g} s "
            f"(EVENTBUS_PUBLISH_TIMEOUT_S): {type(error).__name__}: {error}; the event may or "
            "may not be stored (its event ID tells duplicates apart)"
        )

    def put_back(self, batches: Iterable[list[Slot]], error: Exception) -> None:
        """Return unconfirmed slots to the front of the queue in their order; fail those whose
        deadline passed."""
        now = time.monotonic()
        back = []
        for slot in (s for batch in batches for s in batch if not s.future.done()):
            if now >= slot.deadline:
                slot.settle(self.timed_out(error))
            else:
                back.append(slot)
        self._slots.extendleft(reversed(back))

    def expire(self, error: Exception) -> float:
        """Fail the queued slots whose deadline passed (Redis unreachable: nothing is sent);
        return the earliest deadline of the others (monotonic seconds, inf if none)."""
        now = time.monotonic()
        earliest = math.inf
        waiting = [s for s in self._slots if not s.future.done()]
        self._slots.clear()
        for slot in waiting:
            if slot.deadline <= now:
                slot.settle(self.timed_out(error))
            else:
                earliest = min(earliest, slot.deadline)
                self._slots.append(slot)
        return earliest

    def remove(self, slots: Iterable[Slot]) -> None:
        """Take `slots` out of the queue (their callers send them)."""
        for slot in slots:
            with contextlib.suppress(ValueError):
                self._slots.remove(slot)

    def ready_slots(self) -> list[Slot]:
        """The ready slots whose callers still wait, in order."""
        return [s for s in self._slots if s.stream is not None and not s.future.done()]
