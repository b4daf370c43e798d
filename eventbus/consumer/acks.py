"""Acknowledgement: batched ``XACK`` per shard stream, and the count of entries in flight.

An entry is in flight from the moment it is read (or claimed) until it is *finished*: acked, or
let go unacked because its shard was lost. Acks are sent in one pipeline per wake-up, only with
a valid lease and only for shards still held under the generation the entry was read in: an ack
of an older generation is dropped (its entry stays pending for the current owner, maybe us).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from redis.backoff import AbstractBackoff
from redis.exceptions import ResponseError

from eventbus.client.pipelines import HeldConnection
from eventbus.client.retry import REDIS_ERRORS, Waits
from eventbus.consumer.shards import HeldShard, Item, ShardTable
from eventbus.locking.lease import Lease
from eventbus.locking.member import Member

log = logging.getLogger("eventbus.consumer")


@dataclass(slots=True)
class _Batch:
    held: HeldShard
    generation: int
    ids: list[bytes] = field(default_factory=list)


class Acks:
    """Acks of `member` for the shards of `table` while `lease` is valid (None: no lease, the
    fence of a broadcast consumer's entries always holds), at most
    `settings.max_in_flight` entries in flight; `noack` (at-most-once reads) finishes entries
    without XACK; `backoff` spaces the retries of a failed XACK; `before_send` is called before
    each XACK pipeline (the handling path's metrics are flushed before the entries' acks);
    `on_refused(command)` counts an error reply; `shard_room`: a shard is read again once at
    most this many of its entries are in flight (default `max_in_flight`). Finishing entries
    wakes `table.changed` when a shard or the consumer gets room to read."""

    def __init__(
        self,
        member: Member,
        table: ShardTable,
        lease: Lease | None,
        *,
        noack: bool,
        backoff: AbstractBackoff,
        before_send: Callable[[], None] = lambda: None,
        on_refused: Callable[[str], None] = lambda command: None,
        shard_room: int | None = None,
    ) -> None:
        self.redis, self.group, self.consumer_id = member.redis, member.group, member.consumer_id
        self.table, self.lease = table, lease
        self.max_in_flight = member.settings.max_in_flight
        self.shard_room = self.max_in_flight if shard_room is None else shard_room
        self.noack = noack
        self.waits = Waits(backoff, log)
        self.before_send = before_send
        self.on_refused = on_refused
        self.in_flight = 0
        self._batches: dict[int, _Batch] = {}
        self._sending: dict[int, _Batch] = {}  # the batches of the XACK pipeline on its way
        self._conn = HeldConnection(self.redis)  # the XACK pipelines, one at a time
        # asyncio's events (the consumer runs on asyncio): an `anyio.Event` looks its backend
        # up on every creation, ~8x the cost, and one is made per ack round and per idle spell
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()

    # -- in flight --------------------------------------------------------------------------------
    def started(self, held: HeldShard, n: int = 1) -> None:
        """`n` entries of `held` were read (or claimed): in flight until finished."""
        held.in_flight += n
        self.in_flight += n

    def finish(self, item: Item) -> None:
        self._finish(item.held)

    def _finish(self, held: HeldShard, n: int = 1) -> None:
        """`n` entries of `held` finished."""
        after = held.in_flight - n
        held.in_flight = after
        if after <= self.shard_room < after + n or (held.behind and not after):
            self.table.wake()  # `held` is readable again, or drained for its catch-up
        before = self.in_flight
        self.in_flight = before - n
        if before >= self.max_in_flight > self.in_flight:  # crossed back under the cap
            self.table.wake()
        if self.in_flight == 0:
            self._idle.set()
            self._idle = asyncio.Event()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def drain(self, timeout_s: float, running: Callable[[], int]) -> None:
        """Wait, at most `timeout_s` seconds, until no entry is in flight (graceful shutdown:
        running handlers finish and their acks are sent); log at ERROR what is left after it:
        entries not handled yet (in a handler call, or queued behind one), entries handled
        whose XACK is unconfirmed, and `running()`, the handler calls still running."""
        with anyio.move_on_after(timeout_s) as grace:
            while self.in_flight:
                await self.wait_idle()
        if grace.cancelled_caught:
            handled = sum(len(b.ids) for d in (self._batches, self._sending) for b in d.values())
            fate = (
                "they are lost (ack='before': acknowledged when read)"
                if self.noack
                else "they stay pending and will be delivered again"
            )
            log.error(
                "consumer %s: %d entries unfinished after %.0f s of shutdown: %d not handled "
                "yet, %d handled but their XACKs not confirmed by Redis (%d handler calls still "
                "running); %s",
                self.consumer_id,
                self.in_flight,
                timeout_s,
                self.in_flight - handled,
                handled,
                running(),
                fate,
            )

    # -- acking ---------------------------------------------------------------------------------
    def ack(self, item: Item) -> None:
        """Queue `item`'s XACK (or finish it at once with NOACK reads or a lost shard)."""
        if self.noack or item.held.lost:
            self.finish(item)
            return
        batches = self._batches
        batch = batches.get(item.shard)
        if batch is None or batch.generation != item.generation:
            if batch is not None:  # an older generation's acks: that shard was lost, drop them
                self._settle(batch)
            if not batches:  # the first ack since the loop took the last ones: wake it
                self._wake.set()
            batch = batches[item.shard] = _Batch(item.held, item.generation)
        batch.ids.append(item.entry_id)

    def ack_many(self, items: list[Item]) -> None:
        """`ack` each of `items`, consecutive entries of one shard under one acquisition (a
        batch handler's), in one step."""
        head = items[0]
        if self.noack or head.held.lost or len(items) == 1:
            for item in items:
                self.ack(item)
            return
        self.ack(head)
        self._batches[head.shard].ids.extend([item.entry_id for item in items[1:]])

    async def loop(self) -> None:
        """Send queued acks, one pipeline per wake-up; put them back and back off on errors.
        Holds one pool connection for its pipelines until it ends (cancelled)."""
        try:
            await self._loop()
        finally:
            with anyio.CancelScope(shield=True):
                await self._conn.aclose()

    async def _loop(self) -> None:
        waits = self.waits
        while True:
            await self._wake.wait()
            self._wake = asyncio.Event()
            batches, self._batches = self._batches, {}
            self._sending = batches
            lease = self.lease
            while lease is not None and not lease.ok() and self.table.held:
                await lease.changed()
            current = [
                b for b in batches.values() if self.table.current(b.held.shard, b.generation)
            ]
            try:
                if current:
                    self.before_send()
                    group = self.group
                    await self._conn.execute(
                        [("XACK", b.held.stream, group, *b.ids) for b in current]
                    )
            except REDIS_ERRORS as exc:
                self._sending = {}
                self._put_back(batches)
                self._wake.set()
                if isinstance(exc, ResponseError):  # refused (NOPERM, OOM...): say it loudly
                    self.on_refused("XACK")
                    await waits.wait(None, "Redis refused XACK", exc, level=logging.ERROR)
                else:
                    await waits.wait(None, "XACK failed", exc)
                continue
            waits.ok()
            self._sending = {}
            for b in batches.values():
                self._settle(b)

    def _put_back(self, batches: dict[int, _Batch]) -> None:
        """Re-queue failed batches ahead of newer acks of the same generation."""
        for s, b in batches.items():
            newer = self._batches.get(s)
            if newer is None:
                self._batches[s] = b
            elif newer.generation == b.generation:
                b.ids.extend(newer.ids)
                self._batches[s] = b
            else:  # newer acks belong to a later generation: this batch is stale
                self._settle(b)

    def _settle(self, batch: _Batch) -> None:
        if batch.ids:
            self._finish(batch.held, len(batch.ids))
