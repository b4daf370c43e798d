"""What a broadcast consumer owns: no lock, no lease, its own read positions.

`OpenOwnership` is the ownership part of the broadcast assembly (`eventbus.consumer.broadcast`),
where a group's is `eventbus.consumer.ownership.Ownership`; the pipeline runs its rounds alike.
Every instance reads every shard stream of the topic with plain ``XREAD`` from positions kept
here (`position_reads.PositionReader`), so its table holds every shard for ever (token 0,
generation 0: never lost, never released), its lock round is never due, there is no lease, and
its fence always holds. It takes the start positions (where the streams ended when it started),
moves them on with every read, and its trim check finds the entries trimmed before they were
read (`Gaps`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from redis.typing import KeyT, StreamIdT

from eventbus.client.pipelines import execute
from eventbus.consumer.broadcast_gaps import Gaps, missing
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery
from eventbus.consumer.shards import HeldShard, ShardTable
from eventbus.consumer.supervision import refused
from eventbus.locking.member import Member

if TYPE_CHECKING:
    from eventbus.consumer.running import ReadMarks


class Reading(Protocol):
    """What the trim check asks of the pipeline that reads for the open ownership."""

    read_full: bool
    """Its last read filled a stream's read count: more may have been trimmed meanwhile."""
    held_back: bool
    """It waited for room (`max_in_flight`) since its last read, while the streams grew."""


class OpenOwnership:
    """The open ownership of one broadcast consumer (`member`, `sub`): every shard, no lock.

    `table` holds every shard stream of the topic for ever; `positions` maps a stream to the
    last entry ID read from it; `gaps` counts the entries trimmed before they were read;
    `started` is set once the start positions are taken."""

    noack = True  # entries are finished when handled: nothing is acked
    lease = None  # nothing is locked: reads and handlers are not bounded by a lease

    def __init__(
        self, member: Member, sub: Subscription, on_refused: Callable[[str], None]
    ) -> None:
        """`on_refused(command)` counts a refused command."""
        self.redis, self.consumer_id = member.redis, member.consumer_id
        self.topic, self.group = sub.topic, sub.group
        self.on_refused = on_refused
        self.trim_check_s = member.settings.trim_check_s
        streams = [member.keys.stream(sub.topic.name, s) for s in range(sub.topic.shards)]
        self.table = ShardTable(streams)
        self.table.alone = True  # an idle shard is kept: nobody else could take it
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

    # -- what a round asks (as of `Ownership`): no lock round, nothing to release or drop --------
    def lock_due(self) -> bool:
        return False

    async def lock_round(self, claimer: object) -> None:
        """Never due (`lock_due`): every shard is held from the start."""

    def shard_room(self, count: int) -> int | None:
        """No per-shard read-ahead bound: nothing read ahead is lost to another owner; reads
        stop at `max_in_flight` entries in flight."""
        return None

    def poll_ms(self, block_ms: int) -> int:
        return block_ms

    async def release(self, shards: list[int]) -> None:
        """Never asked: the table keeps idle shards (`ShardTable.alone`)."""

    def drop_all(self, reason: str, *, lease: bool = True) -> None:
        """After a failed read: nothing to drop, the positions are where they were (the read
        that failed moved none) and the next read goes on from them."""

    def wake(self) -> None:
        self.table.wake()

    def let_go(self) -> None:
        """Never asked (an at-most-once consumer's stop handles what it read)."""

    async def check_trims(self, reading: Reading) -> None:
        """Tell the entries trimmed before they were read (`check_gaps`) when a stream's last
        check is `trim_check_s` old, or `reading` may have fallen behind (a full read, a wait
        for room): before the next read moves the positions on."""
        streams = self.table.streams
        if reading.read_full or reading.held_back or self.gaps.due(streams, self.trim_check_s):
            with refused("XINFO / XRANGE (trim check)", ",".join(streams)):
                await self.check_gaps(streams)

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
