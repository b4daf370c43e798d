"""The held-shard table of one consumer: which shard locks it holds, under which acquisition.

Pure bookkeeping, no I/O. Each acquisition of a lock gets a `generation` unique in this process:
entries and acks of an older generation are dropped (their entries stay pending for the owner).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from eventbus.consumer.delivery import Delivery
from eventbus.locking.locks import Grant


@dataclass(slots=True, eq=False)
class HeldShard:
    """Local state of a held shard lock: `token` is its fencing token, `in_flight` the entries
    read and not yet finished, `draining` set above the fair share (no more reads; released
    once drained), `behind` set when the trim check found entries the group had not read trimmed
    to the archive (no more reads until its entries in flight are finished and it is caught up),
    `idle_since` the monotonic time (s) of the first empty read in a row, `lost` set once the
    table no longer holds it under this acquisition (the one flag the per-event fence checks:
    `ShardTable.current` without a lookup)."""

    shard: int
    stream: str
    token: int
    generation: int
    in_flight: int = 0
    draining: bool = False
    behind: bool = False
    idle_since: float | None = None
    lost: bool = False


class Item(Delivery):
    """An entry read by the live consumer, tied to the `HeldShard` it was read under (its shard,
    token and generation are the held shard's): made by `read_item` or `read_items`."""

    held: HeldShard = None  # type: ignore[assignment]  # always given (`read_item`, `read_items`)


def read_item(
    held: HeldShard, entry_id: bytes, fields: dict[bytes, bytes], delivery_count: int = 1
) -> Item:
    """The `Item` of entry `entry_id` (`fields`) read from `held`'s stream."""
    return Item(
        held.shard,
        held.token,
        entry_id,
        fields,
        held.generation,
        0,
        None,
        delivery_count,
        held=held,
    )


def read_items(
    held: HeldShard,
    entries: list[tuple[bytes, dict[bytes, bytes] | None]],
    counts: Mapping[bytes, int] | None,
) -> list[Item]:
    """`Item`s of the `entries` read from `held`'s stream, in order; `counts` gives the delivery
    count of entries delivered before (default 1). An entry without fields (deleted between
    read and claim) has nothing to handle and is skipped."""
    if counts:  # a recovery's or a claim's: not the hot path
        return [
            read_item(held, entry_id, fields, counts.get(entry_id, 1))
            for entry_id, fields in entries
            if fields is not None
        ]
    shard, token, generation = held.shard, held.token, held.generation
    # positionally, in `Delivery`'s field order (half the cost of keywords), `held` last
    return [
        Item(shard, token, entry_id, fields, generation, 0, None, 1, None, None, None, None, held)
        for entry_id, fields in entries
        if fields is not None
    ]


class ShardTable:
    """The shards held, keyed by shard index; `streams[i]` is shard i's stream key. `wake` and
    `changed` signal that what may be read changed: shards dropped, a shard's entries in flight
    fell back under its bound or to none, the consumer's under `max_in_flight`."""

    def __init__(self, streams: list[str]) -> None:
        self.streams = streams
        self.held: dict[int, HeldShard] = {}
        self.alone = False  # the last lock round's share was every shard (`mark_surplus`)
        self._by_stream = {s.encode(): i for i, s in enumerate(streams)}
        self._generations = itertools.count(1)
        # asyncio's event (the consumer runs on asyncio): an `anyio.Event` looks its backend
        # up on every creation, ~8x the cost, and one is made per wake-up
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """Wake whoever waits in `changed`."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Wait for the next `wake`."""
        await self._changed.wait()

    def apply(self, grants: dict[int, Grant]) -> tuple[list[int], list[int]]:
        """Take in a lock round's grants. Returns (shards lost to others, shards newly held:
        taken in this round, or re-taken under a new token). A new shard's pending entries must
        be recovered before it is read."""
        lost = [s for s in self.held if s not in grants]
        self.forget(lost)
        new = []
        for s, grant in grants.items():
            local = self.held.get(s)
            if local is None or grant.is_new or local.token != grant.token:
                if local is not None:
                    local.lost = True
                self.held[s] = HeldShard(s, self.streams[s], grant.token, next(self._generations))
                new.append(s)
        return lost, new

    def current(self, shard: int, generation: int) -> bool:
        """Whether `shard` is still held under acquisition `generation`."""
        held = self.held.get(shard)
        return held is not None and held.generation == generation

    def of_stream(self, stream: bytes) -> HeldShard | None:
        return self.held.get(self._by_stream[stream])

    def readable(self, room: int | None = None) -> list[HeldShard]:
        """The held shards to read: not draining nor behind and, given `room`, with at most
        `room` entries in flight (the per-shard read-ahead bound, `Pipeline.shard_room`)."""
        if room is None:
            return [h for h in self.held.values() if not (h.draining or h.behind)]
        return [
            h for h in self.held.values() if not (h.draining or h.behind) and h.in_flight <= room
        ]

    def mark_surplus(self, share: int) -> None:
        """Above the fair share `share`, mark the least busy shards draining. A share of every
        shard means no other member is live: then an idle shard is kept (`to_release`)."""
        self.alone = share >= len(self.streams)
        active = self.readable()
        surplus = len(active) - share
        if surplus > 0:
            for h in sorted(active, key=lambda h: h.in_flight)[:surplus]:
                h.draining = True

    def to_release(self, read: set[int], now: float, idle_s: float) -> list[int]:
        """Shards to release after a read that got entries from `read`: those idle (nothing read,
        nothing in flight) for `idle_s` seconds since `now`, and drained surplus at once.
        Releasing after one empty read made locks change owner about once per 1.5 events at
        2,000 events/s (a lock, an unlock, a token and an XAUTOCLAIM each time). A member that
        is alone in its group (its last share was every shard) keeps idle shards: nobody else
        could take them, and re-taking them twice a second cost an idle process with many
        groups most of a core."""
        out = []
        for h in self.held.values():
            if h.shard in read or h.in_flight:
                h.idle_since = None
                continue
            if h.idle_since is None:
                h.idle_since = now
            if h.draining or (not self.alone and now - h.idle_since >= idle_s):
                out.append(h.shard)
        return out

    def forget(self, shards: Iterable[int]) -> None:
        for s in shards:
            held = self.held.pop(s, None)
            if held is not None:
                held.lost = True

    def clear(self) -> None:
        """Forget every shard."""
        self.forget(list(self.held))
