"""Gaps found while offloading a held shard: accounted in its checkpoint (fenced), then recorded
in the store, once, whatever crashes in between (docs/tier.md "Gaps").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from eventbus.protocol.ids import EntryId
from eventbus.tier.checkpoint import Checkpoints
from eventbus.tier.gaps import Gap, gap_json, load_gap, new_gap, record_gap
from eventbus.tier.offload_state import OffloadShard

if TYPE_CHECKING:
    from eventbus.tier.offloader import Offloader

log = logging.getLogger("eventbus.tier")


class ShardGaps:
    """The gap steps of `eventbus.tier.shard_offload.ShardOffload` for `owner` (its store, stats,
    consumer ID and test hook) on shards of `topic`, through their `checkpoints`."""

    def __init__(self, owner: Offloader, topic: str, checkpoints: Checkpoints) -> None:
        self.o = owner
        self.topic = topic
        self.checkpoints = checkpoints

    def new_gap(
        self, after: EntryId, before: EntryId, lost: int | None, reason: str, sh: OffloadShard
    ) -> Gap:
        """A gap record of `sh` found by this offloader (`eventbus.tier.gaps.new_gap`)."""
        return new_gap(self.topic, sh.shard, after, before, lost, reason, self.o.consumer_id)

    async def account(
        self, sh: OffloadShard, after: EntryId, before: EntryId, lost: int | None, reason: str
    ) -> bool:
        """Account a gap found from `sh`'s checkpoint, count and read position, then record it
        (docs/tier.md "Gaps"). `Checkpoints.account_gap` adds its entries to the count and keeps
        its record as the shard's unrecorded gap in one fenced step, only while this offloader
        holds the shard with its token and the checkpoint and count are those it was found
        from; only then is the record stored, logged and counted (`record`). A crash in between
        leaves the unrecorded gap to the next owner: recorded once, counted once, never lost.
        Returns False, recording nothing, when the checkpoint or count moved (`sh` is resynced:
        the next round checks again). Raises `Fenced` (a lapsed owner records no gap)."""
        gap = self.new_gap(after, before, lost, reason, sh)
        if gap.key in sh.gaps_seen:
            return True
        body = gap_json(gap)
        me = self.o.consumer_id
        seen = (sh.checkpoint, sh.count)
        for attempt in range(2):
            if await self.checkpoints.account_gap(sh.shard, me, sh.token, seen, lost or 0, body):
                break
            cp = await self.checkpoints.read(sh.shard)
            if cp.gap is not None:  # another gap first (not expected: see recover and work)
                await self.record(sh, cp.gap)
            if (cp.last, cp.count) != seen or attempt:
                log.warning(
                    "offloader %s: the checkpoint of %s shard %d moved (%s, %d accounted; we "
                    "had %s, %d): gap check deferred to the next round",
                    me,
                    self.topic,
                    sh.shard,
                    cp.last,
                    cp.count,
                    sh.checkpoint,
                    sh.count,
                )
                sh.reset_to(cp.last, cp.count)
                return False
        sh.count += lost or 0
        sh.unrecorded = body
        await self.o.hook("gap_accounted", sh.shard, gap.key)
        await self.record(sh, body)
        return True

    async def record_unrecorded(self, sh: OffloadShard) -> None:
        """Record the shard's unrecorded gap in Redis, if any."""
        cp = await self.checkpoints.read(sh.shard)
        if cp.gap is not None:
            await self.record(sh, cp.gap)

    async def record(self, sh: OffloadShard, body: str) -> None:
        """Store the record of a gap already accounted (`body`, its JSON; create-only: a second
        try finds it stored), log and count it, then clear it as the shard's unrecorded gap in
        Redis (fenced). Raises `CorruptGapRecord` when `body` is not a gap record, `StoreError`
        (it stays unrecorded: retried next round), `Fenced`."""
        gap = load_gap(body, f"{self.checkpoints.key} {sh.shard}:gap")
        if await record_gap(self.o.store, gap):
            self.o.stats.gaps += 1
            self.o.stats.lost += gap.lost_entries or 0
        await self.checkpoints.gap_recorded(sh.shard, self.o.consumer_id, sh.token, body)
        sh.unrecorded = None
        sh.gaps_seen.add(gap.key)
