"""The offloader's work on one topic: its ``_offloader`` shard locks and one round over them.

`TopicOffloader.lock` takes this round's share of the topic's shard locks (through
`eventbus.locking.locks.LockClient`) and releases any surplus; `TopicOffloader.round` runs the steps
of `eventbus.tier.shard_offload` on every held shard, a few shards at a time;
`TopicOffloader.heartbeats` keeps the topic's liveness between lock rounds.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import anyio

from eventbus.client.retry import REDIS_ERRORS
from eventbus.locking.lease import heartbeat_loop
from eventbus.locking.locks import Fenced, LockClient
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.tier.errors import StoreError
from eventbus.tier.offload_state import OffloadShard
from eventbus.tier.settings import OFFLOADER_GROUP
from eventbus.tier.shard_offload import ShardOffload

if TYPE_CHECKING:
    from eventbus.tier.offloader import Offloader

log = logging.getLogger("eventbus.tier")

# A shard's step failing with these is logged and retried on the next round; the other shards
# go on meanwhile.
_TRANSIENT: tuple[type[Exception], ...] = (*REDIS_ERRORS, StoreError)
SHARD_CONCURRENCY = 4  # shards of a topic worked on at once by one offloader


class TopicOffloader:
    """The offloader's work on one topic of `shards` shards."""

    def __init__(self, owner: Offloader, topic: str, shards: int) -> None:
        self.o = owner
        self.topic = topic
        self.shards = shards
        self.steps = ShardOffload(owner, topic)
        self.checkpoints = self.steps.checkpoints
        member = Member(
            owner.redis,
            owner.keys,
            owner.settings,
            topic,
            OFFLOADER_GROUP,
            owner.consumer_id,
            EVENTBUS,  # the durable tier reads and writes eventbus's format only
        )
        self.locks = LockClient(member, shards=shards, scripts=owner.scripts)
        self.held: dict[int, OffloadShard] = {}
        self.rotation = random.randrange(shards)
        self.joined = anyio.Event()  # set by the first lock round: then heartbeats start

    # -- locks ----------------------------------------------------------------------------------
    async def lock(self) -> None:
        """Take this round's locks (starting the preference order one shard further each round,
        so offloaders do not all want the same shards first) and release any surplus at once,
        the shards with the smallest buffers first."""
        order = [(self.rotation + i) % self.shards for i in range(self.shards)]
        self.rotation = (self.rotation + 1) % self.shards
        got = await self.locks.acquire(order)
        self.joined.set()
        for s in [s for s in self.held if s not in got.grants]:
            log.warning("offloader %s lost %s shard %d", self.o.consumer_id, self.topic, s)
            del self.held[s]
        for s, grant in got.grants.items():
            local = self.held.get(s)
            if local is None or grant.is_new or local.token != grant.token:
                self.held[s] = OffloadShard(s, grant.token, self.o.keys.stream(self.topic, s))
        surplus = len(self.held) - got.share
        if surplus > 0:
            idle = sorted(self.held.values(), key=lambda sh: len(sh.buffer))[:surplus]
            await self.release([sh.shard for sh in idle])

    async def heartbeats(self) -> None:
        """Refresh this topic's offloader liveness every TTL/3 until cancelled, so long rounds
        keep the locks (`heartbeat_loop`, the consumer's loop). No lease to renew: the
        offloader's checkpoint writes are fenced by token in Redis instead. A heartbeat that
        finds the liveness expired drops the held shards; the next round re-locks."""
        ttl = self.o.settings.liveness_ttl_s
        await heartbeat_loop(self.locks, ttl, self.joined, None, self._expired)

    def _expired(self) -> None:
        if self.held:
            log.warning(
                "offloader %s: liveness had expired; drops %s shards %s until the next round",
                self.o.consumer_id,
                self.topic,
                sorted(self.held),
            )
            self.held.clear()

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

        async def one(sh: OffloadShard) -> None:
            async with limiter:
                try:
                    if not sh.recovered:
                        await self.steps.recover(sh)
                    busy.append(await self.steps.work(sh, now_ms, flush))
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
