"""Running a resource's queue: the step of every worker of a consumer (group or broadcast).

`QueueRunner.run` takes the head of a resource's queue (`eventbus.consumer.queues`) through
the handling path until the queue is empty or its head must wait for a retry. An entry that was
decoded and validated with its read and needs nothing else (no parked resource to look up, no
de-duplication) goes straight to its handler call (`Handling.attempt`) and to `Settle.ack`;
every other entry (control entries,
parked resources, de-duplication, entries decoded at their turn, a fence to wait for) goes
through `Handling.step`. Either way a failed attempt meets the same policy (`Handling.failed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable
from typing import Protocol

from eventbus.consumer.delivery import NOT_STARTED, Fence, Outcome, Step
from eventbus.consumer.handling import Handling
from eventbus.consumer.shards import Item
from eventbus.consumer.watchdog import Slot
from eventbus.protocol.codec import Envelope

log = logging.getLogger("eventbus.consumer")

YIELD_EVERY = 64
"""Entries a worker runs between two yields to the event loop (when its handlers do not
suspend on their own): a busy worker must not starve heartbeats, reads and acks."""


class Settle(Protocol):
    """What becomes of a finished entry: acked (`ack`), or let go unacked (`finish`)."""

    def ack(self, item: Item) -> None: ...

    def finish(self, item: Item) -> None: ...


class QueueRunner:
    """Runs queues through `handling` under `fence`, settling entries with `settle`."""

    def __init__(self, handling: Handling, fence: Fence, settle: Settle) -> None:
        self.handling, self.fence, self.settle = handling, fence, settle

    async def run(self, queue: deque[Item], slot: Slot) -> float | None:
        """Run the head of `queue` until it is empty (None) or its head must wait (the delay
        in s before it is tried again), by the worker whose watchdog slot is `slot`."""
        handling, fence, settle = self.handling, self.fence, self.settle
        failures = handling.failures
        budget = YIELD_EVERY
        while queue:
            d = queue[0]
            # the fast case: decoded with its read, nothing else to do before the handler call
            # (`step` does the rest; the fence is checked by `attempt`, right before the call)
            if d.event is not None and not handling.dedup_s and not failures.parked:
                env: Envelope = d.env  # type: ignore[assignment]  # decoded with its read
                d.attempt += 1
                error = await handling.attempt(d, env, d.event, fence, d.entry_id, d.attempt, slot)
                if error is None:
                    settle.ack(d)
                    queue.popleft()
                else:
                    if error is NOT_STARTED:  # the fence fell: `step` waits for it, or lets go
                        d.attempt -= 1
                        stepping = handling.step(d, fence, slot)
                    else:
                        stepping = handling.failed(d, env, error, fence)
                    delay = await self._settle(d, stepping)
                    if delay is not None:
                        return delay
                    queue.popleft()
            else:
                delay = await self.process(d, slot)
                if delay is not None:
                    return delay
                queue.popleft()
            budget -= 1
            if not budget:
                budget = YIELD_EVERY
                await asyncio.sleep(0)
        return None

    async def process(self, item: Item, slot: Slot | None = None) -> float | None:
        """One `Handling.step` for `item` (the head of its queue), settled; its retry delay."""
        return await self._settle(item, self.handling.step(item, self.fence, slot))

    async def _settle(self, item: Item, stepping: Awaitable[Step]) -> float | None:
        """Await a step for `item` and ack it, let it go, or return its retry delay."""
        try:
            step = await stepping
        except Exception as exc:  # a bug of ours: keep the entry, keep consuming
            log.exception("consumer %s: internal error on an entry", self.handling.consumer_id)
            step = await self.handling.failures.dead_letter(
                item, exc, reason="failed", fence=self.fence
            )
        if step is Outcome.ACK:
            self.settle.ack(item)
        elif step is Outcome.LET_GO:
            self.settle.finish(item)
        else:
            return step
        return None
