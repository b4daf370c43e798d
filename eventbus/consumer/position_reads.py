"""The broadcast's reader: plain ``XREAD`` from an open ownership's positions.

Where a group's `reading.Reader` reads with ``XREADGROUP ... >`` (Redis keeps the group's
position, its pending entries and the fenced delivery's checks), a `PositionReader` reads the
streams after the last entry ID read from each (`open_ownership.OpenOwnership.positions`) and
moves the positions on with what it got: nothing is pending, nothing to recover or claim. The
pipeline's read (`pipeline.Pipeline._read`) calls either alike.

On a single node one ``XREAD ... BLOCK`` covers every shard stream. A Redis Cluster refuses a
multi-slot ``XREAD``: there each stream is first read without BLOCK, all at once; when none had
entries, each is read with BLOCK at once and the first that returns entries ends the others (a
cancelled ``XREAD`` holds nothing: the position did not move, the next read gets its entries).
"""

from __future__ import annotations

from typing import Any

import anyio
from redis.typing import KeyT, StreamIdT

from eventbus.consumer.open_ownership import OpenOwnership
from eventbus.consumer.reading import Dispatch, Read
from eventbus.consumer.shards import HeldShard
from eventbus.locking.member import Member


class PositionReader:
    """Reads `own`'s streams for `member` from `own`'s positions, `count` entries per stream
    at most per read."""

    command = "XREAD"  # what a refusal names (`supervision.refused`)

    def __init__(self, member: Member, own: OpenOwnership, *, count: int) -> None:
        self.redis, self.own, self.count = member.redis, own, count
        self.cluster = member.settings.cluster

    async def read(self, shards: list[HeldShard], block_ms: int) -> list[Read]:
        """New entries of `shards` after their positions, blocking at most `block_ms` ms when
        there are none; the positions move on to the last entry read of each. Raises what the
        client raises (the positions are then where they were)."""
        positions = self.own.positions
        wanted: dict[KeyT, StreamIdT] = {h.stream: positions[h.stream] for h in shards}
        if not self.cluster:
            reply = await self.redis.xread(wanted, count=self.count, block=block_ms)
        else:
            reply = await self._read_each(wanted, block_ms)
        reads = []
        for stream, entries in reply or []:
            if entries:
                read = Read(stream if isinstance(stream, bytes) else stream.encode(), entries)
                reads.append(read)
                self.own.read(read.stream.decode(), entries)
        return reads

    async def _read_each(self, wanted: dict[KeyT, StreamIdT], block_ms: int) -> list[Any]:
        """A Cluster's read: every stream on its own, without BLOCK first, then with it."""
        got: list[Any] = []
        errors: list[Exception] = []

        async def one(stream: KeyT, block: int | None, scope: anyio.CancelScope) -> None:
            try:
                reply = await self.redis.xread(
                    {stream: wanted[stream]}, count=self.count, block=block
                )
            except Exception as exc:  # raised as itself below, not in an exception group
                errors.append(exc)
                scope.cancel()
                return
            if reply and reply[0][1]:
                got.extend(reply)
                if block is not None:
                    scope.cancel()  # the first with entries ends the blocked others

        for block in (None, block_ms):
            async with anyio.create_task_group() as tg:
                for stream in wanted:
                    tg.start_soon(one, stream, block, tg.cancel_scope)
            if errors:
                raise errors[0]
            if got:
                break
        return got

    async def recover(self, shards: list[HeldShard], dispatch: Dispatch, held: Any) -> None:
        """Nothing: a plain read leaves no pending entries (and an open ownership takes no
        shard: it holds them all from the start)."""

    async def regroup(self) -> list[str]:
        """Nothing: there is no group (a plain read never meets ``NOGROUP``)."""
        return []

    async def aclose(self) -> None:
        """Nothing: the reads use the client's pool."""
