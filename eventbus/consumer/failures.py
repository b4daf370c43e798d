"""The failure policy of one subscription: dead letters, parked resources, control entries.

An entry that cannot be handled (undecodable, or failed `max_attempts` times) is written to the
group's dead-letter stream (`eventbus.dlq` documents the record) and only then acked. With
``on_failure="park"`` its resource is parked: the resource's later entries are dead-lettered as
``parked``, in order, until an operator's control entry (``eventbus dlq requeue|drop``, written to
the resource's own shard stream) replays or drops them and unparks it. The parked set is a hash
in Redis; this process keeps a copy for the shards it holds (`load_parked` on every new lock).

Every write to the parked set and to the operator's control requests is fenced in Redis
(``lua/fenced_hash.lua``: applied only while the caller holds the entry's shard lock with the
entry's fencing token). The lease check before a write is the client's; a process paused after it
(or a request delayed past the liveness TTL) would otherwise park, re-park or unpark a resource
after the shard's new owner handled its entries. A write refused there lets the entry go unacked
(`Outcome.LET_GO`): the new owner handles it again, and the consumer is told (`fenced_off`), so
that it stops reading that shard at once rather than at its next lock round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.asyncio.retry import Retry

from eventbus.client import retry as retrying
from eventbus.consumer.context import Subscription
from eventbus.consumer.controls import forged, parked_letters
from eventbus.consumer.delivery import NOT_STARTED, Delivery, Fence, Outcome, Tally, wait_retry
from eventbus.errors import ConfigError, DecodeError
from eventbus.locking.member import Member
from eventbus.locking.scripts import register
from eventbus.ops.metrics import METRICS
from eventbus.protocol.dead_letters import (
    DROP,
    DeadLetter,
    dead_letter_fields,
    parked_resources,
)

if TYPE_CHECKING:
    from eventbus.consumer.handling import Handling

log = logging.getLogger("eventbus.consumer")


class _ShardLost(Exception):
    """The entry's shard was lost while waiting to write: nothing was written."""


class Failures:
    """Dead-letter writes and the parked set of (topic, group); see the module docstring."""

    def __init__(
        self,
        member: Member,
        sub: Subscription,
        retry: Retry,
        tally: Tally,
        *,
        fenced_off: Callable[[Delivery], None] | None = None,
        fence_in_redis: bool = True,
    ) -> None:
        """`fenced_off(d)` is called when Redis refused a fenced write for delivery `d`: the
        lock of `d`'s shard has moved on (the live consumer forgets the shard if it still holds
        it under `d`'s acquisition). `fence_in_redis`: the consumer's shard locks are kept in
        eventbus's lock hash, which ``lua/fenced_hash.lua`` checks (`ShardLocks.fences_writes`;
        catch-up's `LockClient` does). Without it a request delete goes as a plain ``HDEL``,
        and ``on_failure="park"`` raises `ConfigError`: a park could not be fenced."""
        self.sub, self.retry, self.tally = sub, retry, tally
        self._fenced_off = fenced_off
        # Any: redis-py types replies for its sync and async clients at once (``int |
        # Awaitable[int]``), and as str although eventbus's clients answer bytes
        self.redis: Any = member.redis
        keys = member.keys
        self._dlq = keys.dead_letter(sub.topic.name, sub.group)
        self.parked_key = keys.parked(sub.topic.name, sub.group)
        self._control = keys.control(sub.topic.name, sub.group)
        self._locks = keys.locks(sub.topic.name, sub.group)
        self._me = member.consumer_id
        self._fence_in_redis = fence_in_redis
        if sub.options.on_failure == "park" and not fence_in_redis:
            raise ConfigError(
                f"subscriber of topic {sub.topic.name!r}, group {sub.group!r}: "
                f"on_failure='park' needs its writes to the parked set fenced by the shard "
                f"locks (lua/fenced_hash.lua checks eventbus's lock hash), and the "
                f"{member.profile.name} profile's lock client keeps its locks "
                f"elsewhere (its fences_writes is False): use eventbus's lock client "
                f"(profiles.EVENTBUS.lock_client) or on_failure='continue'"
            )
        self._fenced_hash: Any = None  # the script, registered on first use
        self.parked: dict[str, str] = {}  # resource -> its first parked letter's ID
        self._changes = 0  # local parks and unparks, to detect a reload racing them
        self._m_dead = METRICS.dead_lettered.labels(sub.topic.name, sub.group)
        self._kept = member.profile.codec.fields  # what a dead letter keeps

    def gives_up(self, parking: bool) -> str:
        return "dead-lettering and parking the resource" if parking else "dead-lettering"

    # -- dead letters ---------------------------------------------------------------------------
    async def dead_letter(
        self, d: Delivery, exc: BaseException | None, *, reason: str, fence: Fence
    ) -> Outcome:
        """Write `d` to the dead-letter stream; ACK once written, LET_GO if the shard was lost
        first (then it stays pending, unwritten, for the next owner)."""
        if reason == "undecodable":  # every one, wherever it was found (live, catch-up, control)
            log.warning(
                "entry %s of shard %d (topic %s, group %s) is undecodable, dead-lettered: %s",
                d.entry_id.decode(),
                d.shard,
                self.sub.topic.name,
                self.sub.group,
                exc,
            )
        dlq_id = await self._write(d, exc, reason=reason, fence=fence)
        return Outcome.LET_GO if dlq_id is None else Outcome.ACK

    async def dead_letter_and_park(
        self, d: Delivery, exc: BaseException, resource_id: str, fence: Fence
    ) -> Outcome:
        """Dead-letter `d` as failed and park its resource before `d` is acked."""
        dlq_id = await self._write(d, exc, reason="failed", fence=fence)
        if dlq_id is None:
            return Outcome.LET_GO
        if not await self._fenced(d, "park", self.parked_key, "HSETNX", resource_id, dlq_id):
            # its letter is not the resource's any more: the new owner handles the entry again
            # (`_letters` passes over one that could not be deleted)
            await retrying.call(
                self.retry, "stale letter", lambda: self.redis.xdel(self._dlq, dlq_id)
            )
            return Outcome.LET_GO
        self.parked.setdefault(resource_id, dlq_id.decode())
        self._changes += 1
        return Outcome.ACK

    async def _write(
        self, d: Delivery, exc: BaseException | None, *, reason: str, fence: Fence
    ) -> bytes | None:
        """XADD `d` and why to the dead-letter stream, retrying Redis errors while the shard is
        held; its dead-letter entry ID, or None if the shard was lost meanwhile."""
        original = {n: d.fields[n] for n in self._kept if n in d.fields}
        fields = dead_letter_fields(
            topic=self.sub.topic.name,
            group=self.sub.group,
            shard=d.shard,
            entry_id=d.entry_id,
            reason=reason,
            exc=exc,
            attempts=d.attempt,
            original=original,
        )
        if d.segment is not None:
            fields[b"segment"] = d.segment.encode()

        async def write() -> bytes:
            if not await fence.wait(d):
                raise _ShardLost
            dlq_id: bytes = await self.redis.xadd(
                self._dlq, fields, maxlen=self.sub.topic.maxlen, approximate=True
            )
            return dlq_id

        try:
            dlq_id = await retrying.call(self.retry, f"dead-letter write to {self._dlq}", write)
        except _ShardLost:
            return None
        self.tally.dead_lettered += 1
        self._m_dead.inc()
        return dlq_id

    async def _fenced(self, d: Delivery, what: str, key: str, op: str, *args: Any) -> bool:
        """`op` (``HSETNX``, ``HSET``, ``HDEL``) on hash `key` with `args`, applied by Redis only
        while this consumer holds `d`'s shard lock with `d`'s fencing token
        (``lua/fenced_hash.lua``); Redis errors are retried (`retry`). False, logged, when the
        lock had moved on: nothing was written."""
        if not self._fence_in_redis:
            await retrying.call(
                self.retry, what, lambda: getattr(self.redis, op.lower())(key, *args)
            )
            return True
        if self._fenced_hash is None:
            self._fenced_hash = register(self.redis, "fenced_hash")
        script = self._fenced_hash
        keys, argv = [self._locks, key], [d.shard, self._me, d.token, op, *args]
        reply = await retrying.call(self.retry, what, lambda: script(keys, argv))
        if int(reply[0]) or await self._already(key, op, *args):
            return True
        log.warning(
            "consumer %s: %s for entry %s of shard %d refused: the shard's lock moved on "
            "(fencing token %d superseded); the entry is left to the shard's owner",
            self._me,
            what,
            d.entry_id.decode(),
            d.shard,
            d.token,
        )
        if self._fenced_off is not None:
            self._fenced_off(d)
        return False

    async def _already(self, key: str, op: str, field: Any, value: Any = None) -> bool:
        """Whether a refused `_fenced` write is in place all the same: an earlier try of it was
        applied and its reply lost, then the lock moved on. The field holds
        `value` (``HSETNX``, ``HSET``), or is gone (``HDEL``: also when another consumer did it,
        which is the same outcome)."""
        got = await retrying.call(
            self.retry, "fenced write check", lambda: self.redis.hget(key, field)
        )
        if op == "HDEL":
            return got is None
        want = value if isinstance(value, bytes) else str(value).encode()
        return bool(got == want)

    # -- parked resources -----------------------------------------------------------------------
    def is_parked(self, resource_id: str) -> bool:
        return resource_id in self.parked

    async def load_parked(self) -> None:
        """Reload the parked set from Redis (a new shard's resources may have been parked by its
        previous owner). A park or unpark made while the reply was on its way wins."""
        while True:
            changes = self._changes
            raw = await self.redis.hgetall(self.parked_key)
            if changes == self._changes:
                self.parked = parked_resources(raw, self.parked_key)
                return

    async def control(self, d: Delivery, fence: Fence, handling: Handling) -> Outcome:
        """Execute a control entry: replay (``unpark``) or drop (``drop``) a parked resource's
        letters, in order, then unpark it. Runs in the resource's queue, so the resource's later
        events wait until it is done. Control entries naming another group are acked and ignored
        (that group's consumers check them); one whose nonce names no request recorded by the
        operator (`eventbus.dlq`) is dead-lettered as ``forged``, not executed."""
        try:
            env = await handling.envelope(d.fields)
        except DecodeError as exc:
            return await self.dead_letter(d, exc, reason="undecodable", fence=fence)
        payload = env.payload if isinstance(env.payload, dict) else {}
        group = payload.get("group")
        if isinstance(group, str) and group != self.sub.group:
            return Outcome.ACK
        rid = env.resource_id
        nonce = payload.get("nonce")
        forgery = await forged(self.redis, self.retry, self._control, d, nonce, env.event_type, rid)
        if forgery is not None:
            log.error("entry %s of shard %d: %s", d.entry_id, d.shard, forgery)
            return await self.dead_letter(d, forgery, reason="forged", fence=fence)
        assert isinstance(nonce, str)
        first = await retrying.call(
            self.retry, "parked lookup", lambda: self.redis.hget(self.parked_key, rid)
        )
        if first is None:  # unparked meanwhile (or a redelivery after the unpark)
            return await self._request_done(d, nonce)
        letters = await parked_letters(
            self.redis, self.retry, self._dlq, rid, self._first(rid, first)
        )
        if env.event_type == DROP:
            if letters:
                ids = [x.dlq_id for x in letters]
                await retrying.call(self.retry, "drop", lambda: self.redis.xdel(self._dlq, *ids))
            log.warning("resource %r unparked; %d parked events dropped", rid, len(letters))
        else:
            for letter in letters:
                if await self._replay(d, letter, fence, handling):
                    continue
                # parked again, from this letter on; the control entry stays pending when the
                # shard was lost meanwhile (the next owner resumes)
                if not await fence.wait(d) or not await self._set_parked(d, rid, letter.dlq_id):
                    return Outcome.LET_GO
                return await self._request_done(d, nonce)
            log.info("resource %r unparked after replaying %d events", rid, len(letters))
        if not await fence.wait(d) or not await self._fenced(
            d, "unpark", self.parked_key, "HDEL", rid
        ):
            return Outcome.LET_GO
        self.parked.pop(rid, None)
        self._changes += 1
        return await self._request_done(d, nonce)

    def _first(self, rid: str, value: bytes) -> str:
        """The dead-letter ID to scan `rid`'s parked letters from: its parked hash's `value`.
        One that is not UTF-8 (any client may write the hash) names no ID: the letters are
        looked up from the start of the dead-letter stream (they are found by resource ID, as
        `parked_resources` keeps such a resource parked), with a WARNING naming key and field."""
        try:
            return value.decode()
        except UnicodeDecodeError:
            log.warning(
                "parked hash %s: the value of field %r is not UTF-8 (no dead-letter ID): its "
                "parked letters are looked up from the start of %s",
                self.parked_key,
                rid,
                self._dlq,
            )
            return "-"

    async def _request_done(self, d: Delivery, nonce: str) -> Outcome:
        """Delete the operator's request: its control entry `d` has been executed (ACK), or the
        shard was lost first (LET_GO: the next owner finds the work done and deletes it)."""
        done = await self._fenced(d, "control request delete", self._control, "HDEL", nonce)
        return Outcome.ACK if done else Outcome.LET_GO

    async def _set_parked(self, d: Delivery, rid: str, dlq_id: str) -> bool:
        if not await self._fenced(d, "re-park", self.parked_key, "HSET", rid, dlq_id):
            return False
        self.parked[rid] = dlq_id
        self._changes += 1
        return True

    async def _replay(
        self, control: Delivery, letter: DeadLetter, fence: Fence, handling: Handling
    ) -> bool:
        """Run the handler on a parked letter (with retries in place) and delete the letter on
        success. False when it still fails (or the shard was lost): the resource stays parked."""
        try:
            env, event = await handling.decoded(letter.original())
        except DecodeError as exc:
            log.error("parked letter %s is undecodable (%s); left in place", letter.dlq_id, exc)
            return False
        policy = self.sub.options.retry
        attempt = 1
        while attempt <= policy.max_attempts:
            if not await fence.wait(control):
                return False
            error = await handling.attempt(
                control, env, event, fence, letter.entry_id.encode(), attempt
            )
            if error is NOT_STARTED:
                continue  # nothing ran: wait for the lease again, same attempt
            if error is None:
                await retrying.call(
                    self.retry,
                    "delete replayed letter",
                    lambda: self.redis.xdel(self._dlq, letter.dlq_id),
                )
                return True
            if attempt < policy.max_attempts:
                await wait_retry(policy.delay_s(attempt), handling.stopping)
            attempt += 1
        log.error("parked letter %s still fails after %d attempts", letter.dlq_id, attempt - 1)
        return False
