"""The entries of a broadcast consumer's streams trimmed before it read them (`Gaps`): counted,
logged at ERROR and in ``eventbus_trimmed_unread_total``, never silent
(`eventbus.consumer.broadcast`; a group's: `eventbus.consumer.trims`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.typing import KeyT, StreamIdT

from eventbus.client.pipelines import execute
from eventbus.ops.metrics import METRICS
from eventbus.protocol.ids import parse_id

log = logging.getLogger("eventbus.consumer")

COUNT_LIMIT = 10_000  # most entries counted with XRANGE in one trim check (as for groups)


class Gaps:
    """The entries of a broadcast consumer's streams trimmed before it read them.

    Per stream it keeps ``read``: the stream's ``entries-added`` when the consumer took its
    start position, plus every entry read since. Then ``entries-added - read`` entries are
    neither read nor before the start: those still in the stream after the read position, and
    the lost ones. `check` counts the former (the stream's length when the position lies before
    its first entry, else ``XRANGE`` after the position, skipped past `COUNT_LIMIT` entries until
    the backlog shrinks) and reports any increase of the difference. Call it only while the
    positions and counts of its streams stand still (between two reads of them)."""

    def __init__(self, consumer_id: str, topic: str, group: str, shards: dict[str, int]) -> None:
        """`shards`: stream key -> shard number (for the log)."""
        self.consumer_id, self.topic, self.group, self.shards = consumer_id, topic, group, shards
        self.read: dict[str, int] = {}  # stream -> entries-added at the start + entries read
        self.lost: dict[str, int] = {}  # stream -> entries found trimmed unread so far
        self.checked_at: dict[str, float] = {}  # stream -> time.monotonic() of its last check
        self._m_trimmed = METRICS.trimmed_unread.labels(topic, group)

    def start(self, stream: str, info: Any) -> None:
        """Count from the stream's ``XINFO STREAM`` reply `info` (an exception: no stream yet)
        taken with the start position."""
        self.read[stream] = 0 if isinstance(info, Exception) else int(info["entries-added"])
        self.lost[stream] = 0
        self.checked_at[stream] = time.monotonic()

    def due(self, streams: list[str], interval_s: float) -> bool:
        """Whether one of `streams` was not checked for `interval_s` seconds."""
        now = time.monotonic()
        return any(now - self.checked_at[s] >= interval_s for s in streams)

    def count_read(self, stream: str, n: int) -> None:
        self.read[stream] += n

    async def check(self, redis: Any, positions: dict[KeyT, StreamIdT], streams: list[str]) -> int:
        """Check `streams` (read positions in `positions`); log at ERROR and count each increase
        of their entries trimmed unread. Returns the number newly found. Raises the client's
        connection errors and error replies but "no such key" (a stream not created yet)."""
        pipe = redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_stream(stream)
        infos = await execute(pipe, raise_on_error=False)
        found = 0
        for stream, info in zip(streams, infos, strict=True):
            self.checked_at[stream] = time.monotonic()
            if missing(info):
                continue
            position = text(positions[stream])
            lost = await self._lost(redis, stream, position, info)
            if lost is None or lost <= self.lost[stream]:
                continue
            new, self.lost[stream] = lost - self.lost[stream], lost
            found += new
            self._m_trimmed.inc(new)
            log.error(
                "broadcast consumer %s: %d entries of topic %s shard %d were trimmed before it "
                "read them (after %s), never delivered to this instance (MAXLEN too small for "
                "its backlog? see docs/operations.md, stream caps)",
                self.consumer_id,
                new,
                self.topic,
                self.shards[stream],
                position,
            )
        return found

    async def _lost(self, redis: Any, stream: str, position: str, info: Any) -> int | None:
        added, length = int(info["entries-added"]), int(info["length"])
        unread = added - self.read[stream]
        if added == length or unread <= 0:
            return self.lost[stream]  # nothing ever left the stream, or nothing unread
        first = info.get("first-entry")
        if not first or parse_id(text(first[0])) > parse_id(position):
            after = length  # every entry of the stream lies after the position
        elif unread > COUNT_LIMIT:
            return None  # too many to count now
        else:
            after = len(await redis.xrange(stream, min="(" + position, count=unread + 1))
        return max(self.lost[stream], unread - after)


def missing(info: Any) -> bool:
    """Whether an ``XINFO STREAM`` reply says the stream does not exist; raises any other
    error reply."""
    if isinstance(info, Exception):
        if "no such key" not in str(info).lower():
            raise info
        return True
    return False


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
