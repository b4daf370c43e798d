"""Reading a consumer's shards: consumer groups, pending-entry recovery, ``XREADGROUP``.

Recovery: a new owner of a shard lock claims the shard's pending entries list (PEL) with
``XAUTOCLAIM <stream> <group> <me> 0 0-0`` (min idle 0: holding the lock makes it the rightful
owner; Redis docs, XAUTOCLAIM) and queues them before reading anything new, so per-resource order
holds across a crash, a pause, or a graceful leave (which leaves read-but-unstarted entries).

Reads: one ``XREADGROUP ... BLOCK`` over the held shards on a single node. A Redis Cluster refuses
a multi-slot XREADGROUP, so there each stream is read without BLOCK in one pipeline (grouped per
node by redis-py), with an adaptive pause when all were empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio

from eventbus.config import Settings
from eventbus.consumer.shards import HeldShard
from eventbus.metrics import METRICS

log = logging.getLogger("eventbus.consumer")

Entries = list[tuple[bytes, dict[bytes, bytes] | None]]
Dispatch = Callable[[HeldShard, Entries], None]


class Reader:
    """Reads for member `consumer_id` of `group` over the topic's shard `streams`."""

    def __init__(
        self,
        redis: Any,
        settings: Settings,
        topic: str,
        group: str,
        consumer_id: str,
        streams: list[str],
        *,
        noack: bool,
    ) -> None:
        self.redis = redis
        self.group = group
        self.consumer_id = consumer_id
        self.streams = streams
        self.noack = noack
        self.count = settings.read_count
        self.cluster = settings.cluster
        self.start_id = "0" if settings.start == "beginning" else "$"
        self._m_lost = METRICS.lost.labels(topic, group)

    async def ensure_groups(self) -> None:
        """``XGROUP CREATE ... MKSTREAM`` on every shard stream (BUSYGROUP: it exists)."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, self.group, id=self.start_id, mkstream=True)
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result

    async def recover(
        self, shards: list[HeldShard], dispatch: Dispatch, held: Callable[[HeldShard], bool]
    ) -> None:
        """Claim and dispatch the PEL of `shards`, in entry-ID order, page by page; the first
        page of every shard goes in one pipeline (most PELs are empty). A shard for which
        `held` turns False is left (the next owner claims its entries again). Raises what the
        client raises: the caller must not read a shard whose recovery failed."""
        pipe = self.redis.pipeline(transaction=False)
        for h in shards:
            pipe.xautoclaim(h.stream, self.group, self.consumer_id, 0, "0-0", count=self.count)
        for h, page in zip(shards, await pipe.execute(), strict=True):
            cursor, entries, deleted = page
            while held(h):
                if entries:
                    log.info(
                        "consumer %s recovers %d pending entries of shard %d",
                        self.consumer_id,
                        len(entries),
                        h.shard,
                    )
                    dispatch(h, entries)
                if deleted:
                    self._m_lost.inc(len(deleted))
                    log.error(
                        "shard %s: %d pending entries were trimmed before being processed "
                        "(stream cap too small?): %s",
                        h.stream,
                        len(deleted),
                        deleted[:5],
                    )
                if cursor in (b"0-0", "0-0"):
                    break
                cursor, entries, deleted = await self.redis.xautoclaim(
                    h.stream, self.group, self.consumer_id, 0, cursor, count=self.count
                )

    async def read(self, shards: list[HeldShard], block_ms: int) -> list[tuple[bytes, Entries]]:
        """New entries (``>``) of `shards`, blocking at most `block_ms` ms when there are none."""
        if not self.cluster:
            replies = await self.redis.xreadgroup(
                self.group,
                self.consumer_id,
                {h.stream: ">" for h in shards},
                count=self.count,
                block=block_ms,
                noack=self.noack,
            )
            return replies or []
        pipe = self.redis.pipeline()
        for h in shards:
            pipe.xreadgroup(
                self.group, self.consumer_id, {h.stream: ">"}, count=self.count, noack=self.noack
            )
        replies = [r for res in await pipe.execute() for r in (res or [])]
        if not any(entries for _, entries in replies):
            await anyio.sleep(block_ms / 1000)
        return replies
