"""What a broadcast consumer owns: no lock, no lease, its own read positions.

`OpenOwnership` is the ownership part of the broadcast assembly (`eventbus.consumer.broadcast`),
where a group's is `eventbus.consumer.ownership.Ownership`. Every instance reads every shard
stream of the topic with plain ``XREAD`` from positions kept here, so its table holds every
shard for ever (token 0, generation 0: never lost), there is no lock round and no lease, and its
fence always holds. It takes the start positions (where the streams ended when it started),
moves them on with every read, and finds the entries trimmed before they were read (`Gaps`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from redis.typing import KeyT, StreamIdT

from eventbus.client.pipelines import execute
from eventbus.consumer.broadcast_gaps import Gaps, missing
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery
from eventbus.consumer.shards import HeldShard, ShardTable
from eventbus.locking.member import Member

if TYPE_CHECKING:
    from eventbus.consumer.running import ReadMarks


class OpenOwnership:
    """The open ownership of one broadcast consumer (`member`, `sub`): every shard, no lock.

    `table` holds every shard stream of the topic for ever; `positions` maps a stream to the
    last entry ID read from it; `gaps` counts the entries trimmed before they were read;
    `started` is set once the start positions are taken."""

    def __init__(self, member: Member, sub: Subscription) -> None:
        self.redis, self.consumer_id = member.redis, member.consumer_id
        self.topic, self.group = sub.topic, sub.group
        streams = [member.keys.stream(sub.topic.name, s) for s in range(sub.topic.shards)]
        self.table = ShardTable(streams)
        for s, stream in enumerate(streams):  # never lost: nothing is locked
            self.table.held[s] = HeldShard(s, stream, token=0, generation=0)
        self.by_stream = {stream: self.table.held[s] for s, stream in enumerate(streams)}
        self.positions: dict[KeyT, StreamIdT] = {}
        self.gaps = Gaps(
            self.consumer_id,
            sub.topic.name,
            sub.group,
            {stream: s for s, stream in enumerate(streams)},
        )
        self.started = anyio.Event()

    # -- the fence: it always holds (`Fence`) -----------------------------------------------------
    def holds(self, d: Delivery) -> bool:
        return True

    async def wait(self, d: Delivery) -> bool:
        return True

    def ok(self) -> bool:
        """Whether it reads: what a readiness check asks of a group's lease
        (`eventbus.ops.health`); true once the start positions are taken."""
        return self.started.is_set()

    # -- positions --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the streams' last entries as start positions (``XINFO STREAM``: with the count
        of entries ever added, for `Gaps`); a missing stream starts at ``0-0``. Raises other
        error replies."""
        streams = self.table.streams
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_stream(stream)
        for stream, info in zip(streams, await execute(pipe, raise_on_error=False), strict=True):
            last = None if missing(info) else info.get("last-entry")
            self.positions[stream] = last[0] if last else b"0-0"
            self.gaps.start(stream, info)
        self.started.set()

    def read(self, stream: str, entries: list[Any]) -> None:
        """`entries` (non-empty, in order) were read from `stream`: read on after the last."""
        self.positions[stream] = entries[-1][0]
        self.gaps.count_read(stream, len(entries))

    async def check_gaps(self, streams: list[str]) -> None:
        """Tell the entries of `streams` trimmed before they were read (`Gaps.check`); only
        while their positions stand still (between two reads of them)."""
        await self.gaps.check(self.redis, self.positions, streams)

    def mark_reads(self, marks: Callable[[str], ReadMarks]) -> None:
        """Its position on every shard stream of the topic, kept here: no group in Redis
        tells what it read (`Running.mark_reads`)."""
        for stream in self.table.streams:
            marks(stream).positions.append(
                (self.consumer_id, functools.partial(self.positions.get, stream))
            )
