"""What a shard's catch-up hands entries to (`Handle`, `BatchHandle`, `RowsHandle`) and what
it counts (`CatchUpStats`), re-exported by `eventbus.tier.catchup_shard`; an entry read from
Redis as a handle takes it (`redis_entry`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE
from eventbus.protocol.ids import EntryId
from eventbus.tier.archived import ArchivedEntry, EntryBatch

if TYPE_CHECKING:
    from eventbus.tier.catchup_shard import ShardCatchUp

Handle = Callable[[ArchivedEntry, "ShardCatchUp"], Awaitable[None]]
"""How a shard's catch-up handles one entry: a raw handler, or the subscription's handling path
(`eventbus.consumer.catchup.TypedCatchUp`), which needs the shard's fence. A handle with a
`BatchHandle.batch` method is given the entries of a segment's batch (or a Redis page) at
once; one with a `RowsHandle.rows` method too is given a segment's rows as read (an
`EntryBatch`), without the `ArchivedEntry` objects it does not need."""


class BatchHandle(Protocol):
    """A `Handle` that also takes consecutive entries of one shard at once (the handling
    path's batches: `eventbus.consumer.catchup.TypedCatchUp`)."""

    async def __call__(self, entry: ArchivedEntry, sc: ShardCatchUp) -> None: ...

    async def batch(self, entries: Sequence[ArchivedEntry], sc: ShardCatchUp) -> int:
        """Handle `entries` in order; returns how many were finished, in order, before the
        rest were let go (the shard's lock lost, or the consumer stopping): ``len(entries)``
        when all were. Raises what the handler path raises."""
        ...


class RowsHandle(BatchHandle, Protocol):
    """A `BatchHandle` that also takes a batch of a segment's matching rows as read: the
    typed handling path, which needs each entry's ID and fields only (`EntryBatch.
    stream_entries`), not the `ArchivedEntry` objects (making them and the items from them:
    ≈ 40 % of a flights catch-up's samples, stress/results/replay-profile-s5.md)."""

    async def rows(self, batch: EntryBatch, sc: ShardCatchUp) -> int:
        """Handle the rows of `batch` in order; returns as `BatchHandle.batch`."""
        ...


@dataclass
class CatchUpStats:
    """What a catch-up did: entries handled from segments and from Redis (pending entries still
    there), pending entries acked, entries known lost, shards done; seconds of wall time."""

    from_segments: int = 0
    from_redis: int = 0
    pending_acked: int = 0
    lost_ranges: int = 0
    shards: int = 0
    seconds: float = 0.0


def redis_entry(
    topic: str, shard: int, entry_id: EntryId, fields: dict[bytes, bytes]
) -> ArchivedEntry:
    """A stream entry read from Redis (its ID and field map) as the `ArchivedEntry` a handle
    takes: envelope fields the handling path decodes from ``data`` left None."""

    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode("utf-8", "replace")

    return ArchivedEntry(
        topic=topic,
        shard=shard,
        entry_id=entry_id,
        resource_id=text(F_RESOURCE),
        event_type=text(F_TYPE),
        published_at_ms=None,  # in the envelope (F_DATA), decoded by the handling path
        event_id=None,
        headers=None,
        data=fields.get(F_DATA, b""),
        segment="",  # read from Redis, not from a segment
    )
