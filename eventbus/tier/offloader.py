"""The offloader: shard streams -> segments in the object store, then checkpoint, then trim.

The life of a shard under one offloader (docs/tier.md states the protocol and its safety):

1. **Lock.** Each round `eventbus.locking.locks.LockClient` refreshes the offloader's liveness and
   takes shard locks of the special group ``_offloader`` (`OFFLOADER_GROUP`), up to the fair share
   ``ceil(shards / live offloaders)``; surplus locks are released at once, so several offloaders
   split a topic's shards. A lock comes with a fencing token.
2. **Recover** (when a lock is newly taken). A gap accounted but not yet recorded is recorded
   (its JSON is kept in the checkpoint hash). A pending *intent* left in the checkpoint hash
   (a crash or a paused owner between "begin" and "commit") is finished first: the same entry
   range is re-read from Redis and put under the same key; if the object already exists it is
   verified and adopted. Then segments stored past the checkpoint (found by listing after the
   checkpoint's key) are verified and adopted, so the checkpoint never lags the store.
3. **Detect gaps** (`eventbus.tier.gaps`) with ``XINFO STREAM``; a gap is accounted in the
   checkpoint hash (fenced, from the current checkpoint and count) before its record is stored.
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

This module holds the `Offloader` (which topics, the run loop, starting each topic's heartbeats,
"until caught up"); `eventbus.tier.topic_offload` takes a topic's locks, keeps its liveness
(`eventbus.locking.lease.heartbeat_loop`) and runs its rounds (step 1);
`eventbus.tier.shard_offload` does steps 2 to 6 on one shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from eventbus.client import retry
from eventbus.client.retry import REDIS_ERRORS
from eventbus.config import Settings
from eventbus.errors import ConfigError
from eventbus.locking.locks import new_member_id
from eventbus.locking.scripts import Scripts
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.keys import Keys, check_name
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.settings import TierSettings
from eventbus.tier.store import Store
from eventbus.tier.topic_offload import TopicOffloader
from eventbus.tier.typed import TypedPayloads, load_models

log = logging.getLogger("eventbus.tier")

Hook = Callable[[str, int, str], Awaitable[None]]
"""Test hook: ``await hook(point, shard, key)`` at "before_put", "after_put", "after_commit",
"gap_accounted" (key: the gap record's, accounted in Redis, not yet stored)."""


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
        self.keys = Keys.of(self.settings)
        self.acked_topics: set[str] = set()  # retention "acked": never trim past the groups
        self.scripts = Scripts.register(redis)
        self.consumer_id = consumer_id or f"offloader-{new_member_id()}"
        # Failed rounds (Redis unavailable) are retried after 0.1 s doubling up to one poll
        # interval, so an outage costs no more polls than idling, and recovery is noticed soon.
        self._retry = retry.forever(self.settings.retry_base_s, self.tier.poll_interval_s)
        self.stats = OffloadStats()
        self._topic_names = list(topics) if topics is not None else None
        self._topics: dict[str, TopicOffloader] = {}
        self._skipped: set[str] = set()
        self._hook = hook
        # `run`'s task group for the topics' heartbeats (`TopicOffloader.heartbeats`); None
        # outside `run`: `run_until_caught_up`'s short rounds refresh liveness by locking
        self._heartbeats: anyio.abc.TaskGroup | None = None
        # typed segments: a model that cannot be imported fails here, not in a round
        self.typed = {
            topic: TypedPayloads(load_models(spec, f"typed_models[{topic!r}]") or {})
            for topic, spec in self.tier.typed_models.items()
        }

    async def hook(self, point: str, shard: int, key: str) -> None:
        if self._hook is not None:
            await self._hook(point, shard, key)

    async def _refresh_topics(self) -> list[TopicOffloader]:
        """The topics to work on: those registered (among `topics`, if given), except those
        that cannot be archived (logged at ERROR and counted once, then left alone: their
        entries stay in Redis)."""
        raw = await self.redis.hgetall(self.keys.topics())
        stored = {k.decode(errors="replace"): v for k, v in raw.items()}
        retention = await self.redis.hgetall(self.keys.retention())
        self.acked_topics = {
            k.decode(errors="replace") for k, v in retention.items() if v == b"acked"
        }
        names = self._topic_names if self._topic_names is not None else sorted(stored)
        for name in names:
            if name in self._topics or name in self._skipped or name not in stored:
                continue
            problem = _unarchivable(name, stored[name])
            if problem is None:
                t = self._topics[name] = TopicOffloader(self, name, int(stored[name]))
                if self._heartbeats is not None:  # in `run`: the topic's heartbeats start
                    self._heartbeats.start_soon(t.heartbeats)
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
                self._heartbeats = tg
                for t in self._topics.values():  # topics met before `run` (by `round`)
                    tg.start_soon(t.heartbeats)
                while not stop.is_set():
                    # Redis errors are retried with backoff (capped at one poll interval, so a
                    # stop during an outage is noticed within that)
                    busy = await retry.call(self._retry, what, round_unless_stopped, logger=log)
                    if not busy:
                        with anyio.move_on_after(self.tier.poll_interval_s):
                            await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._heartbeats = None
            with anyio.CancelScope(shield=True):
                await self.close()

    async def close(self) -> None:
        """Release every lock this offloader holds and leave the offloader groups."""
        for t in self._topics.values():
            try:
                await t.release(list(t.held), leave=True)
            except REDIS_ERRORS as exc:  # no retry: their liveness lapses after the TTL anyway
                log.error("offloader %s could not release its locks: %s", self.consumer_id, exc)

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
