"""The offloader: shard streams -> segments in the object store, then checkpoint, then trim.

The life of a shard under one offloader (docs/tier.md states the protocol and its safety):

1. **Lock.** Each round `eventbus.locks.LockClient` refreshes the offloader's liveness and takes
   shard locks of the special group ``_offloader`` (`OFFLOADER_GROUP`), up to the fair share
   ``ceil(shards / live offloaders)``; surplus locks are released at once, so several
   offloaders split a topic's shards. A lock comes with a fencing token.
2. **Recover** (when a lock is newly taken). A pending *intent* left in the checkpoint hash
   (a crash or a paused owner between "begin" and "commit") is finished first: the same entry
   range is re-read from Redis and put under the same key; if the object already exists it is
   verified and adopted. Then segments stored past the checkpoint (found by listing after the
   checkpoint's key) are verified and adopted, so the checkpoint never lags the store.
3. **Detect gaps** (`eventbus.tier.gaps`) with ``XINFO STREAM``.
4. **Read** with ``XRANGE`` after the last entry read, into an in-memory buffer. Not a consumer
   group: the offloader needs no pending list or acks (its checkpoint is its position) and must
   not appear as a lagging group in ``XINFO GROUPS`` or hold back anything keyed on groups.
5. **Write** a segment when the buffer reaches ``segment_max_entries`` or
   ``segment_max_bytes`` or its oldest entry is ``segment_max_age_s`` old (entry ID time, Redis
   clock): record the intent (fenced), encode (worker thread), put create-only, commit the
   checkpoint (fenced). The key depends only on the intent's range, so every retry or rival
   writes the same key, and create-only makes the first put win.
6. **Trim** ``XTRIM MINID`` to the smaller of "just after the checkpoint" and "now minus
   ``hot_window_s``": only archived entries older than the hot window leave Redis.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
from redis.exceptions import ResponseError

from eventbus import retry
from eventbus.config import Settings
from eventbus.errors import ConfigError
from eventbus.keys import Keys, check_name
from eventbus.locks import Grant, LockClient, new_member_id
from eventbus.retry import REDIS_ERRORS
from eventbus.scripts import Scripts
from eventbus.tier.checkpoint import Checkpoints, Fenced, Intent
from eventbus.tier.errors import CorruptSegment, StoreError
from eventbus.tier.gaps import find_gap, new_gap, record_gap
from eventbus.tier.ids import EntryId, parse_id
from eventbus.tier.layout import SegmentRef, segment_key
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.segment import RawEntry, decode_segment, encode_segment
from eventbus.tier.settings import OFFLOADER_GROUP, TierSettings
from eventbus.tier.store import Store, get_bytes, list_segments, put_create

log = logging.getLogger("eventbus.tier")

# A shard's step failing with these is logged and retried on the next round; the other shards
# go on meanwhile.
_TRANSIENT: tuple[type[Exception], ...] = (*REDIS_ERRORS, StoreError)
_MAX_SEGMENTS_PER_ROUND = 8  # per shard, so one backlog does not starve the other shards
SHARD_CONCURRENCY = 4  # shards of a topic worked on at once by one offloader

Hook = Callable[[str, int, str], Awaitable[None]]
"""Test hook: ``await hook(point, shard, key)`` at "before_put", "after_put", "after_commit"."""


@dataclass
class OffloadStats:
    """Counters of one offloader since it started. Bytes are bytes, seconds are seconds."""

    segments: int = 0
    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    adopted: int = 0
    gaps: int = 0
    lost: int = 0
    skipped_topics: int = 0
    """Registered topics never archived: their name or shard count is invalid (logged once)."""
    seconds: float = 0.0

    @property
    def compression_ratio(self) -> float:
        """Raw entry bytes per stored byte (0.0 before the first segment)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


@dataclass
class _Shard:
    """The offload state of a held shard lock (`grant`); dropped with the lock."""

    grant: Grant
    stream: str
    checkpoint: EntryId | None = None
    count: int = 0  # entries accounted for (archived + recorded lost)
    buffer: list[RawEntry] = field(default_factory=list)
    buffer_bytes: int = 0
    read_to: EntryId | None = None  # last entry read into the buffer (or the checkpoint)
    recovered: bool = False
    gaps_seen: set[str] = field(default_factory=set)

    @property
    def shard(self) -> int:
        return self.grant.shard

    @property
    def token(self) -> int:
        return self.grant.token

    def reset_to(self, checkpoint: EntryId | None, count: int) -> None:
        self.checkpoint, self.count = checkpoint, count
        self.buffer = [e for e in self.buffer if checkpoint is None or e[0] > checkpoint]
        self.buffer_bytes = sum(_size(f) for _, f in self.buffer)
        self.read_to = self.buffer[-1][0] if self.buffer else checkpoint


def _size(fields: dict[bytes, bytes]) -> int:
    return sum(map(len, fields)) + sum(map(len, fields.values()))


def _unarchivable(topic: str, shards: bytes) -> str | None:
    """Why a registered topic cannot be archived, or None. Such topics come from foreign or
    older clients that wrote the registry without validating; one must not stop the others."""
    try:
        check_name("topic", topic)
    except ConfigError as exc:
        return str(exc)
    if topic in (".", ".."):  # the topic is a folder of the store: no store accepts these
        return f"topic name {topic!r} cannot be a folder of the object store"
    if not shards.isdigit() or int(shards) < 1:
        return f"its shard count {shards!r} is not a positive integer"
    return None


class _TopicOffloader:
    """The offloader's work on one topic."""

    def __init__(self, owner: Offloader, topic: str, shards: int) -> None:
        self.o = owner
        self.topic = topic
        self.shards = shards
        self.checkpoints = Checkpoints(owner.redis, owner.keys, topic)
        self.locks = LockClient(
            owner.redis,
            owner.keys,
            topic,
            OFFLOADER_GROUP,
            owner.consumer_id,
            shards=shards,
            liveness_ttl_s=owner.settings.liveness_ttl_s,
            scripts=owner.scripts,
        )
        self.held: dict[int, _Shard] = {}
        self.rotation = random.randrange(shards)

    # -- locks ----------------------------------------------------------------------------------
    async def lock(self) -> None:
        """Take this round's locks (starting the preference order one shard further each round,
        so offloaders do not all want the same shards first) and release any surplus at once,
        the shards with the smallest buffers first."""
        order = [(self.rotation + i) % self.shards for i in range(self.shards)]
        self.rotation = (self.rotation + 1) % self.shards
        got = await self.locks.acquire(order)
        for s in [s for s in self.held if s not in got.grants]:
            log.warning("offloader %s lost %s shard %d", self.o.consumer_id, self.topic, s)
            del self.held[s]
        for s, grant in got.grants.items():
            local = self.held.get(s)
            if local is None or grant.is_new or local.token != grant.token:
                self.held[s] = _Shard(grant, self.o.keys.stream(self.topic, s))
        surplus = len(self.held) - got.share
        if surplus > 0:
            idle = sorted(self.held.values(), key=lambda sh: len(sh.buffer))[:surplus]
            await self.release([sh.shard for sh in idle])

    async def release(self, shards: list[int], leave: bool = False) -> None:
        await self.locks.release(shards, leave=leave)
        for s in shards:
            self.held.pop(s, None)

    # -- one round ------------------------------------------------------------------------------
    async def round(self, now_ms: int, flush: bool) -> bool:
        """Work on every held shard once, up to `SHARD_CONCURRENCY` shards at a time (Redis
        reads of one overlap the encoding and put of another). Returns True if any shard wrote a
        segment or has more to read right away. Errors other than transient ones and fencing
        (e.g. `CorruptSegment`) are raised after the other shards finished their step."""
        await self.lock()
        busy: list[bool] = []
        fatal: list[BaseException] = []
        limiter = anyio.CapacityLimiter(SHARD_CONCURRENCY)

        async def one(sh: _Shard) -> None:
            async with limiter:
                try:
                    if not sh.recovered:
                        await self.recover(sh)
                    busy.append(await self.work(sh, now_ms, flush))
                except Fenced:
                    log.warning(
                        "offloader %s was fenced off %s shard %d (lock taken over)",
                        self.o.consumer_id,
                        self.topic,
                        sh.shard,
                    )
                    self.held.pop(sh.shard, None)
                except _TRANSIENT as exc:
                    log.warning(
                        "offload of %s shard %d failed (%s); retrying", sh.stream, sh.shard, exc
                    )
                except Exception as exc:
                    fatal.append(exc)

        async with anyio.create_task_group() as tg:
            for sh in list(self.held.values()):
                tg.start_soon(one, sh)
        if fatal:
            raise fatal[0]
        return any(busy)

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, sh: _Shard) -> None:
        """Finish a pending intent, then adopt segments stored past the checkpoint."""
        cp = await self.checkpoints.read(sh.shard)
        sh.reset_to(cp.last, cp.count)
        if cp.pending is not None:
            await self.finish(sh, cp.pending)
        after = None if sh.checkpoint is None else SegmentRef(sh.checkpoint, sh.checkpoint, "")
        for ref in await list_segments(self.o.store, self.topic, sh.shard, after=after):
            if sh.checkpoint is not None and ref.first <= sh.checkpoint:
                continue
            rows = await self.verify_existing(ref.key, sh.shard, ref.first, ref.last)
            log.warning(
                "offloader %s adopts %s, stored past the checkpoint of %s shard %d",
                self.o.consumer_id,
                ref.key,
                self.topic,
                sh.shard,
            )
            await self.commit(sh, ref.last, rows, adopted=True)
        sh.recovered = True

    async def verify_existing(self, key: str, shard: int, first: EntryId, last: EntryId) -> int:
        """Read and verify an existing segment; returns its row count. Raises `CorruptSegment`
        (an object under our key that is not a whole, valid segment is never adopted)."""
        data = await get_bytes(self.o.store, key)
        _, info = await anyio.to_thread.run_sync(
            lambda: decode_segment(
                data, key, expect=(self.topic, shard, first, last), columns=["entry_id"]
            )
        )
        return info.entries

    async def finish(self, sh: _Shard, intent: Intent) -> None:
        """Complete a pending intent: same range, same key; adopt the object if it exists."""
        rows = await self.xrange(sh.stream, str(intent.first), str(intent.last), None)
        key = segment_key(self.topic, sh.shard, intent.first, intent.last)
        log.warning(
            "offloader %s finishes pending segment %s (%d of %d entries still in Redis)",
            self.o.consumer_id,
            key,
            len(rows),
            intent.entries,
        )
        stored: int | None = None
        if rows:
            stored = await self.put(sh, intent, rows, key)
        else:
            try:
                stored = await self.verify_existing(key, sh.shard, intent.first, intent.last)
                TIER_METRICS.adopted.labels(self.topic).inc()
                self.o.stats.adopted += 1
            except FileNotFoundError:
                stored = None
        if stored is None or stored < intent.entries:
            lost = intent.entries - (stored or 0)
            after = intent.first.prev() if intent.first > EntryId(0, 0) else intent.first
            reason = "trimmed from Redis while its segment was being written"
            await self.gap(sh, after, intent.last.next(), lost, reason)
        await self.commit(sh, intent.last, stored or 0)

    # -- steady state ---------------------------------------------------------------------------
    async def work(self, sh: _Shard, now_ms: int, flush: bool) -> bool:
        o = self.o
        try:
            info = await o.redis.xinfo_stream(sh.stream)
        except ResponseError:  # no such key: nothing published on this shard yet
            return False
        found = find_gap(info, sh.read_to, sh.count, len(sh.buffer))
        if found is not None:
            after, before, lost, reason = found
            await self.gap(sh, after, before, lost, reason)
        written = 0
        more = False
        while written < _MAX_SEGMENTS_PER_ROUND:
            more = await self.fill(sh)
            if not sh.buffer:
                break
            age_ms = now_ms - sh.buffer[0][0].ms
            full = (
                len(sh.buffer) >= o.tier.segment_max_entries
                or sh.buffer_bytes >= o.tier.segment_max_bytes
            )
            if not (full or flush or age_ms >= o.tier.segment_max_age_s * 1000):
                break
            await self.write(sh)
            written += 1
        await self.trim(sh, now_ms)
        return written > 0 or more

    async def fill(self, sh: _Shard) -> bool:
        """Read entries after `read_to` until the buffer is full. Returns True when the buffer
        filled up before the stream ran out (there is more to read)."""
        tier = self.o.tier
        while (
            len(sh.buffer) < tier.segment_max_entries and sh.buffer_bytes < tier.segment_max_bytes
        ):
            want = min(tier.read_count, tier.segment_max_entries - len(sh.buffer))
            start = "-" if sh.read_to is None else f"({sh.read_to}"
            rows = await self.xrange(sh.stream, start, "+", want)
            for entry_id, fields in rows:
                sh.buffer.append((entry_id, fields))
                sh.buffer_bytes += _size(fields)
            if rows:
                sh.read_to = rows[-1][0]
            if len(rows) < want:
                return False
        return True

    async def xrange(self, stream: str, start: str, end: str, count: int | None) -> list[RawEntry]:
        """XRANGE `stream` `start` `end` (all of it, paged, when `count` is None)."""
        if count is not None:
            raw = await self.o.redis.xrange(stream, start, end, count=count)
            return [(parse_id(i), f) for i, f in raw]
        out: list[RawEntry] = []
        while True:
            raw = await self.o.redis.xrange(stream, start, end, count=self.o.tier.read_count)
            out += [(parse_id(i), f) for i, f in raw]
            if len(raw) < self.o.tier.read_count:
                return out
            start = f"({out[-1][0]}"

    async def write(self, sh: _Shard) -> None:
        """Archive a prefix of the buffer as one segment: intent, put, commit."""
        tier = self.o.tier
        n, size = 0, 0
        for _, fields in sh.buffer[: tier.segment_max_entries]:
            n += 1
            size += _size(fields)
            if size >= tier.segment_max_bytes:
                break
        batch = sh.buffer[:n]
        intent = Intent(batch[0][0], batch[-1][0], n)
        if not await self.checkpoints.begin(sh.shard, self.o.consumer_id, sh.token, intent):
            # another intent pending, or our buffer is stale: resync
            cp = await self.checkpoints.read(sh.shard)
            sh.reset_to(cp.last, cp.count)
            if cp.pending is not None:
                await self.finish(sh, cp.pending)
            return
        key = segment_key(self.topic, sh.shard, intent.first, intent.last)
        await self.put(sh, intent, batch, key)
        await self.commit(sh, intent.last, n)

    async def put(self, sh: _Shard, intent: Intent, rows: Sequence[RawEntry], key: str) -> int:
        """Encode and put `rows` under `key` create-only; returns the rows the stored object
        holds (ours, or those of an identical-range object already there)."""
        o = self.o
        data, info = await anyio.to_thread.run_sync(
            lambda: encode_segment(
                self.topic, sh.shard, intent.first, intent.last, rows, zstd_level=o.tier.zstd_level
            )
        )
        await o.hook("before_put", sh.shard, key)
        started = time.monotonic()
        created = await put_create(o.store, key, data)
        TIER_METRICS.put_seconds.labels(self.topic).observe(time.monotonic() - started)
        await o.hook("after_put", sh.shard, key)
        if not created:
            stored = await self.verify_existing(key, sh.shard, intent.first, intent.last)
            log.warning("segment %s already stored (retry or rival offloader): adopted", key)
            TIER_METRICS.adopted.labels(self.topic).inc()
            o.stats.adopted += 1
            return stored
        labels = TIER_METRICS
        labels.segments.labels(self.topic).inc()
        labels.entries.labels(self.topic).inc(info.entries)
        labels.raw_bytes.labels(self.topic).inc(info.raw_bytes)
        labels.stored_bytes.labels(self.topic).inc(len(data))
        o.stats.segments += 1
        o.stats.entries += info.entries
        o.stats.raw_bytes += info.raw_bytes
        o.stats.stored_bytes += len(data)
        return info.entries

    async def commit(self, sh: _Shard, last: EntryId, entries: int, adopted: bool = False) -> None:
        await self.checkpoints.commit(sh.shard, self.o.consumer_id, sh.token, last, entries)
        if adopted:
            TIER_METRICS.adopted.labels(self.topic).inc()
            self.o.stats.adopted += 1
        cp = await self.checkpoints.read(sh.shard)
        sh.reset_to(cp.last, cp.count)
        await self.o.hook("after_commit", sh.shard, str(last))

    async def gap(
        self, sh: _Shard, after: EntryId, before: EntryId, lost: int | None, reason: str
    ) -> None:
        """Record the gap first, then account its entries: a crash in between re-detects it
        (recording it again at worst), never leaves a counted but unrecorded loss."""
        gap = new_gap(self.topic, sh.shard, after, before, lost, reason, self.o.consumer_id)
        if gap.key in sh.gaps_seen:
            return
        if await record_gap(self.o.store, gap):
            self.o.stats.gaps += 1
            self.o.stats.lost += lost or 0
        await self.checkpoints.account_lost(sh.shard, self.o.consumer_id, sh.token, lost or 0)
        sh.count += lost or 0
        sh.gaps_seen.add(gap.key)

    async def trim(self, sh: _Shard, now_ms: int) -> None:
        if sh.checkpoint is None:
            return
        hot_edge = EntryId(max(0, now_ms - int(self.o.tier.hot_window_s * 1000)), 0)
        minid = min(sh.checkpoint.next(), hot_edge)
        await self.o.redis.xtrim(
            sh.stream, minid=str(minid), approximate=not self.o.tier.trim_exact
        )


class Offloader:
    """Archives the shard streams of `topics` (all registered topics when None) to `store`.

    `consumer_id` identifies this offloader in the ``_offloader`` locks (default: host, pid and
    a random suffix); a restarted offloader given the same ID gets its locks back at once
    instead of after the liveness TTL. `stats` counts what this instance did.
    """

    def __init__(
        self,
        redis: Any,
        store: Store,
        *,
        settings: Settings | None = None,
        tier: TierSettings | None = None,
        topics: Sequence[str] | None = None,
        consumer_id: str | None = None,
        hook: Hook | None = None,
    ) -> None:
        self.redis = redis
        self.store = store
        self.settings = settings or Settings()  # type: ignore[call-arg,unused-ignore]  # fields from env
        self.tier = tier or TierSettings()  # type: ignore[call-arg,unused-ignore]
        self.keys = Keys(self.settings.key_prefix, self.settings.hashtag)
        self.scripts = Scripts.register(redis)
        self.consumer_id = consumer_id or f"offloader-{new_member_id()}"
        # Failed rounds (Redis unavailable) are retried after 0.1 s doubling up to one poll
        # interval, so an outage costs no more polls than idling, and recovery is noticed soon.
        self._retry = retry.forever(self.settings.retry_base_s, self.tier.poll_interval_s)
        self.stats = OffloadStats()
        self._topic_names = list(topics) if topics is not None else None
        self._topics: dict[str, _TopicOffloader] = {}
        self._skipped: set[str] = set()
        self._hook = hook

    async def hook(self, point: str, shard: int, key: str) -> None:
        if self._hook is not None:
            await self._hook(point, shard, key)

    async def _refresh_topics(self) -> list[_TopicOffloader]:
        """The topics to work on: those registered (among `topics`, if given), except those
        that cannot be archived (logged at ERROR and counted once, then left alone: their
        entries stay in Redis)."""
        raw = await self.redis.hgetall(self.keys.topics())
        stored = {k.decode(errors="replace"): v for k, v in raw.items()}
        names = self._topic_names if self._topic_names is not None else sorted(stored)
        for name in names:
            if name in self._topics or name in self._skipped or name not in stored:
                continue
            problem = _unarchivable(name, stored[name])
            if problem is None:
                self._topics[name] = _TopicOffloader(self, name, int(stored[name]))
                continue
            log.error("offloader %s skips topic %r: %s", self.consumer_id, name, problem)
            self._skipped.add(name)
            self.stats.skipped_topics += 1
        return [self._topics[n] for n in names if n in self._topics]

    async def _now_ms(self) -> int:
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def round(self, *, flush: bool = False) -> bool:
        """One pass over every topic's held shards. `flush` writes partial segments regardless
        of size and age. Returns True when there is more work right away."""
        started = time.monotonic()
        busy = False
        now_ms = await self._now_ms()
        for t in await self._refresh_topics():
            busy |= await t.round(now_ms, flush)
        self.stats.seconds += time.monotonic() - started
        return busy

    async def run(self, stop: anyio.Event) -> None:
        """Offload until `stop` is set, then release every lock and leave (graceful shutdown:
        buffered, unwritten entries simply stay in Redis for the next owner)."""
        log.info("offloader %s starts", self.consumer_id)
        what = f"offloader {self.consumer_id}: round"

        async def round_unless_stopped() -> bool:
            return False if stop.is_set() else await self.round()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                while not stop.is_set():
                    # Redis errors are retried with backoff (capped at one poll interval, so a
                    # stop during an outage is noticed within that)
                    busy = await retry.call(self._retry, what, round_unless_stopped, logger=log)
                    if not busy:
                        with anyio.move_on_after(self.tier.poll_interval_s):
                            await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def close(self) -> None:
        """Release every lock this offloader holds and leave the offloader groups."""
        for t in self._topics.values():
            try:
                await t.release(list(t.held), leave=True)
            except REDIS_ERRORS as exc:  # no retry: their liveness lapses after the TTL anyway
                log.error("offloader %s could not release its locks: %s", self.consumer_id, exc)

    async def _heartbeat_loop(self) -> None:
        """Refresh liveness every TTL/3 during long rounds. A failed refresh is not retried: the
        next tick is the retry, and the locks stay valid until the TTL runs out."""
        while True:
            await anyio.sleep(self.settings.liveness_ttl_s / 3)
            for t in list(self._topics.values()):
                try:
                    was_live = await t.locks.heartbeat()
                except REDIS_ERRORS as exc:
                    log.debug("offloader %s: heartbeat failed (%s)", self.consumer_id, exc)
                    continue
                if not was_live and t.held:
                    log.warning("offloader %s: liveness had expired; re-locking", self.consumer_id)
                    t.held.clear()

    async def run_until_caught_up(self, timeout_s: float | None = None) -> OffloadStats:
        """Archive everything in the streams now (partial segments included), then release the
        locks and return.

        Shards held by other offloaders count as caught up once no unarchived entry up to the
        last one present at the start is left in Redis. Raises `TimeoutError` after
        `timeout_s` seconds (None: no limit).
        """
        try:
            with anyio.fail_after(timeout_s):
                targets = await self._targets()
                while True:
                    busy = await self.round(flush=True)
                    if not busy and await self._caught_up(targets):
                        return self.stats
                    if not busy:
                        await anyio.sleep(self.tier.poll_interval_s / 10)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def _targets(self) -> dict[tuple[str, int], EntryId]:
        targets = {}
        for t in await self._refresh_topics():
            for s in range(t.shards):
                last = await self.redis.xrevrange(self.keys.stream(t.topic, s), count=1)
                if last:
                    targets[(t.topic, s)] = parse_id(last[0][0])
        return targets

    async def _caught_up(self, targets: dict[tuple[str, int], EntryId]) -> bool:
        """True when, for every shard, no entry up to its target is left unarchived in Redis."""
        for (topic, shard), target in targets.items():
            cp = await self._topics[topic].checkpoints.read(shard)
            if cp.last is not None and cp.last >= target:
                continue
            start = "-" if cp.last is None else f"({cp.last}"
            if await self.redis.xrange(self.keys.stream(topic, shard), start, str(target), count=1):
                return False
        return True


async def offload_until_caught_up(
    redis: Any,
    store: Store,
    *,
    topics: Sequence[str] | None = None,
    settings: Settings | None = None,
    tier: TierSettings | None = None,
    timeout_s: float | None = None,
) -> OffloadStats:
    """Archive every entry now in the shard streams of `topics` (default: all registered) to
    `store`, then trim per the hot window; returns what this call wrote.

    For demos and batch jobs (``eventbus offload --once``). Raises `StoreError` when the store
    fails, `CorruptSegment` when an object under a segment key is not a valid segment, and
    `TimeoutError` after `timeout_s` seconds.
    """
    offloader = Offloader(redis, store, settings=settings, tier=tier, topics=topics)
    return await offloader.run_until_caught_up(timeout_s)


__all__ = ["CorruptSegment", "OffloadStats", "Offloader", "offload_until_caught_up"]
