"""The one client of the lock protocol: shard locks and liveness of one (topic, group) member.

Consumers, the offloader (group ``_offloader``) and catch-up all take shard locks through
`LockClient`, which calls the Lua scripts ``lock_shards``, ``unlock_shards`` and ``heartbeat``
(``lua/*.lua``; docs/protocol.md is the spec) and parses their replies into typed values.

A member is live while its score in the group's members sorted set (a deadline in Redis server
time) lies in the future. ``lock_shards`` refreshes that deadline, takes locks that are free, held
by a member whose liveness expired, or already held by the caller, up to the caller's fair share
(``floor(shards / live members)``, one more for the first ``shards mod live members`` members by
consumer ID: the shares add up to the shards), and increments a lock's fencing token on every
change of owner.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from redis.exceptions import NoPermissionError

from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts, register

log = logging.getLogger("eventbus.locking")


def new_member_id() -> str:
    """A member ID unique across machines and restarts: ``<host>-<pid>-<8 hex digits>``."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class LockState(IntEnum):
    """How the caller came to hold a lock (the third field of each ``lock_shards`` triple)."""

    HELD = 0
    """The caller already held it before this call."""
    TAKEN_FREE = 1
    """The lock was free: nobody held it (a previous owner may have left entries pending)."""
    TAKEN_FROM_DEAD = 2
    """The previous owner's liveness had expired: it crashed, hung or was partitioned away."""


_UNUSABLE = 3
"""The state ``verse_lock_shards.lua`` gives a lock key it could not read (`LockRound.unusable`)."""


class Fenced(Exception):
    """The caller no longer holds the lock with the fencing token it was given (another member
    took it over, or it was released): what it was about to do under the lock was not done."""


@dataclass(frozen=True, slots=True)
class Grant:
    """A shard lock the caller holds, with its fencing token (grows on every change of owner)."""

    shard: int
    token: int
    state: LockState

    @property
    def is_new(self) -> bool:
        """The lock changed owner in this call: recover the shard's pending entries first."""
        return self.state is not LockState.HELD


@dataclass(frozen=True, slots=True)
class LockRound:
    """The reply of one `LockClient.acquire`.

    `share` is the caller's fair share: floor(shards / live members), one more for the first
    (shards mod live members) members by consumer ID (``lock_shards.lua``); `grants` maps each
    shard the caller holds after the call (including locks held before it, even above the share)
    to its `Grant`;
    `sent_at` is the `time.monotonic()` at which the request was sent, the earliest instant the
    refreshed liveness can count from (so the start of a lease); `unusable` maps each candidate
    shard whose lock key the script could not read (``verse_lock_shards.lua``: a key of another
    type) to the server's error: neither taken nor held, the other shards unaffected;
    `refreshed` is False for a round that only checked the held locks (`LockClient.poll`): it
    did not refresh the member's liveness, so it starts no lease.
    """

    share: int
    grants: dict[int, Grant]
    sent_at: float
    unusable: dict[int, str] = field(default_factory=dict)
    refreshed: bool = True

    @classmethod
    def parse(cls, reply: list[Any], sent_at: float) -> LockRound:
        """The round a lock script replied (``lock_shards.lua``, ``verse_lock_shards.lua``):
        ``[share, [shard, token, state], ...]``, where ``[shard, 0, 3, error]`` is an unusable
        lock key; `sent_at` as the field."""
        grants, unusable = {}, {}
        for s, token, state, *error in reply[1:]:
            if int(state) == _UNUSABLE:
                why = error[0] if error else "unusable"
                unusable[int(s)] = why.decode() if isinstance(why, bytes) else str(why)
            else:
                grants[int(s)] = Grant(int(s), int(token), LockState(int(state)))
        return cls(int(reply[0]), grants, sent_at, unusable)

    def taken(self, shards: Iterable[int]) -> tuple[int, int]:
        """Of `shards` (newly held), how many locks were free and how many were taken over from
        a member whose liveness had expired: the `ShardMetrics.round` counts."""
        states = [g.state for g in map(self.grants.get, shards) if g is not None]
        return states.count(LockState.TAKEN_FREE), states.count(LockState.TAKEN_FROM_DEAD)


class ShardLocks(Protocol):
    """What a consumer needs of a lock client: `LockClient` (eventbus's lock keys) and
    `eventbus.locking.verse.VerseLockClient` (Verse's) both are one; a wire profile
    (`eventbus.profiles`) says which a consumer gets."""

    member_id: str
    shards: int
    fences_writes: bool
    """Whether ``lua/fenced_hash.lua`` can fence a consumer's writes by these locks: they are
    kept in eventbus's lock hash (`Keys.locks` of the member's topic and group: ``"<shard>"`` ->
    member ID, ``"<shard>:token"`` -> fencing token). Parking needs it (`Failures`)."""

    @property
    def acquiring(self) -> bool: ...

    async def acquire(self, candidates: Sequence[int]) -> LockRound: ...

    async def poll(self, candidates: Sequence[int]) -> LockRound: ...

    async def release(self, shards: Iterable[int], *, leave: bool = False) -> list[int]: ...

    async def heartbeat(self) -> bool: ...


FULL_ROUNDS_PER_INTERVAL = 4.0
"""How many of a group's `LockClient.poll` rounds per lock interval run the whole script anyway,
in expectation over the group (each member's poll does with odds 4 * share / shards, about 4 /
members): they drop members whose liveness expired (docs/protocol.md, "The steady round"). A
member whose last scan gave it every shard was alone: it has nobody to drop, and never does."""


class LockClient:
    """Lock protocol client for `member` (its topic, group and member ID; the liveness TTL of its
    settings: how long, in seconds, after a refresh the member counts as live).

    :param shards: the topic's shard count (for the fair share)
    :param scripts: the registered scripts to share (default: registered on `member.redis`); on
        a Cluster the scripts' keys share one hashtag, so they run on one node
    :param full_rounds: `FULL_ROUNDS_PER_INTERVAL` (0: a `poll` at an unchanged epoch never runs
        the script on its own)
    """

    fences_writes = True  # its locks are eventbus's lock hash (`ShardLocks.fences_writes`)

    def __init__(
        self,
        member: Member,
        *,
        shards: int,
        scripts: Scripts | None = None,
        full_rounds: float = FULL_ROUNDS_PER_INTERVAL,
    ) -> None:
        self.member_id = member.consumer_id
        self._redis = member.redis
        self._full_rounds = full_rounds
        self._plain_reads = True  # False once the role refused HMGET: `poll` runs the script
        self.shards = shards
        self._ttl_ms = int(member.settings.liveness_ttl_s * 1000)
        self._scripts = scripts or Scripts.register(member.redis)
        topic, group = member.topic, member.group
        self._keys = [
            member.keys.members(topic, group),
            member.keys.locks(topic, group),
            member.keys.lock_epoch(topic, group),
        ]
        self._acquiring = 0  # `acquire` calls awaiting their reply
        self._confirm_lock = register(member.redis, "confirm_lock")
        # The group's epoch at this member's last scan of every shard ("": none valid) and the
        # shards that scan and the rounds since left it holding: while the epoch stays, a
        # round reads only those (``lock_shards.lua``; docs/protocol.md).
        self._epoch = ""
        self._held: dict[int, Grant] = {}
        self._share = 0  # the fair share of the last lock round
        self._every: list[int] = []  # range(shards) twice: rotations are slices of it

    @property
    def owed(self) -> bool:
        """Whether the last round left this member below its fair share (it joined, or its
        share grew): its next round may come early (a poll until a release moves the epoch)."""
        return len(self._held) < self._share

    @property
    def acquiring(self) -> bool:
        """Whether a lock round is in flight: `acquire` was called and has not returned or
        raised yet. Its reply may say that locks were lost while the member's liveness had
        lapsed (the round made it live again), so a heartbeat answered meanwhile proves
        nothing about the locks the caller believes it holds (`lease.heartbeat_loop`). The
        caller of `acquire` must apply its reply (or forget its locks when it raises) before
        its next ``await``: this turns False when `acquire` returns."""
        return self._acquiring > 0

    async def acquire(self, candidates: Sequence[int]) -> LockRound:
        """Refresh liveness and take free or expired locks among `candidates` (in order of
        preference) up to the fair share; report every lock held after the call. Given every
        shard, it scans them only if owed shards or unsure what it holds (docs/protocol.md).

        Raises `redis.exceptions.RedisError` (or `OSError`) as the client does; a reply lost with
        the connection may still have taken locks, which the next call reports as held.
        """
        sent_at = time.monotonic()
        candidates = list(candidates)
        every = len(candidates) == self.shards  # (the caller lists each shard at most once)
        epoch = self._epoch if every else ""
        held = sorted(self._held) if epoch else []
        # every shard in order from one: sent as that one (4,096 shards: 4,096 arguments less)
        start = candidates[0] if every and candidates == self._from(candidates[0]) else ""
        self._epoch = ""  # until this round's reply says otherwise (a lost reply: scan again)
        self._acquiring += 1
        try:
            reply = await self._scripts.lock_shards(
                keys=self._keys,
                args=[self.member_id, self._ttl_ms, self.shards, epoch, len(held), *held, start]
                + ([] if start != "" else candidates),
            )
        finally:
            self._acquiring -= 1
        share = int(reply[0])  # -1: the share of this member's last scan (the epoch held)
        got = LockRound.parse([self._share if share < 0 else share, *reply[2:]], sent_at)
        self._share = got.share
        self._held = dict(got.grants)
        epoch = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        self._epoch = epoch if every else ""
        return got

    async def poll(self, candidates: Sequence[int]) -> LockRound:
        """`acquire`'s reply, at the cost of what changed: when this member scanned every shard
        at the group's current epoch, every lock it holds is still its own under the same
        fencing token and the epoch hash counts as many locks of its own, one pipelined read
        (``HMGET`` of the epoch and of the held shards' owner and token fields) answers what
        the script would: the same locks held and share, nothing to take (`LockRound.refreshed`
        False: no liveness refresh, so no lease starts from it; the heartbeat keeps liveness).
        Otherwise (a scan when an owner, token or the count differs), and at random
        `full_rounds` times per lock interval over the group (`FULL_ROUNDS_PER_INTERVAL`), it
        runs `acquire`. Raises what `acquire` raises."""
        candidates = list(candidates)
        share = self._share
        # Alone at its last scan (share == shards > 1: no fair share of two or more members
        # is every shard; with one shard the first of two members has share 1 too): a member
        # that came since changed the epoch. Otherwise the random full rounds drop dead members.
        alone = share == self.shards > 1
        odds = 0.0 if alone else self._full_rounds * share / self.shards
        if not (
            self._plain_reads
            and self._epoch
            and share > 0
            and len(candidates) == self.shards
            and random.random() >= odds
        ):
            return await self.acquire(candidates)
        sent_at = time.monotonic()
        held = sorted(self._held)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self._keys[2], ["since", "n", f"held:{self.member_id}"])
        if held:
            pipe.hmget(self._keys[1], [f for s in held for f in (str(s), f"{s}:token")])
        try:
            [since, n, owned], *fields = await pipe.execute()
        except NoPermissionError as exc:  # a role from before HMGET (docs/security.md)
            self._plain_reads = False
            log.warning(
                "lock rounds of %s run the lock script every interval: its Redis user may not "
                "send HMGET outside scripts (%s); grant +hmget (docs/security.md) for cheaper "
                "steady rounds",
                self.member_id,
                exc,
            )
            return await self.acquire(candidates)
        if f"{_text(since)}:{_text(n or b'0')}" != self._epoch:
            return await self.acquire(candidates)  # (the script scans only when owed shards)
        if int(owned or 0) != len(held):  # it owns a lock it does not know of (a release
            self._epoch = ""  # lost with a failover, docs/protocol.md): a scan finds it
            return await self.acquire(candidates)
        values = fields[0] if held else []
        for i, s in enumerate(held):
            # another owner or token at the same epoch: only after a failover to a replica that
            # lost writes (the epoch numbers came back); the script says what is still held
            owner, token = _text(values[2 * i]), _text(values[2 * i + 1])
            if owner != self.member_id or token != str(self._held[s].token):
                self._epoch = ""  # scan every shard: a lock lost at this epoch may be free
                return await self.acquire(candidates)
        grants = {s: Grant(s, self._held[s].token, LockState.HELD) for s in held}
        return LockRound(share, grants, sent_at, refreshed=False)

    def _from(self, start: int) -> list[int]:
        """Every shard in order from `start`: ``start, start + 1, …, shards - 1, 0, …``."""
        if len(self._every) != 2 * self.shards:
            self._every = list(range(self.shards)) * 2
        return self._every[start : start + self.shards]

    async def release(self, shards: Iterable[int], *, leave: bool = False) -> list[int]:
        """Release the locks of `shards` this member holds (others' are left alone); with
        `leave`, also drop out of the live members, so others count the fair share without it
        at once. Returns the shards released. Fencing tokens are kept: they only grow."""
        if leave:
            self._epoch = ""
        released = [
            int(s)
            for s in await self._scripts.unlock_shards(
                keys=self._keys, args=[self.member_id, int(leave), *shards]
            )
        ]
        for s in released:
            self._held.pop(s, None)
        return released

    async def confirm(self, shard: int, token: int) -> bool:
        """Refresh liveness if the member is still live and holds `shard`'s lock with fencing
        token `token` (``lua/confirm_lock.lua``); never revives a lapsed member nor takes a lock,
        unlike `acquire`. Returns whether it held it: False means drop the shard."""
        return bool(
            await self._confirm_lock(
                keys=self._keys[:2], args=[self.member_id, self._ttl_ms, shard, token]
            )
        )

    async def heartbeat(self) -> bool:
        """Refresh liveness if the member is still live. Returns whether it was; False means
        its liveness had lapsed (or it never joined) and its locks may have been taken: drop
        them and re-lock. A lapsed member stays lapsed until its next `acquire`, whose reply
        says which locks it still holds (``heartbeat.lua`` revives no member)."""
        live = bool(
            await self._scripts.heartbeat(keys=self._keys[:1], args=[self.member_id, self._ttl_ms])
        )
        if not live:
            self._epoch = ""  # its locks may be others' now: the next round scans
        return live


def _text(value: bytes | str | None) -> str:
    """A Redis reply as text, whatever the client's ``decode_responses`` (None: "")."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
