"""The consumer's start and read loop, and what they do when Redis fails them.

* At **start** (topic registry, consumer groups, a broadcast's start positions), a connection
  loss is retried with the backoff until Redis answers or the stop is set (WARNING each time):
  an app may start while Redis restarts or fails over. Everything else raises at once: an error
  reply (NOPERM...), a wrong password, `ShardCountMismatch`. An unreachable Redis at the very
  start of `EventBus.run` is raised before (`RedisUnavailable`), so a wrong URL fails loudly.

* A **connection error** (or timeout): the reply of a read may have been lost with the connection
  and delivered entries into our PEL, so every shard is forgotten (its PEL is claimed again, in
  order, when re-locked) and the loop backs off (WARNING).
* An **error reply** (NOPERM under an ACL, OOM, READONLY after a failover...) is not transient,
  but an operator can fix it without restarting the consumer: the loop keeps backing off (up to
  `retry_max_s`), logs the refused command and the server's reason at ERROR every time, and counts
  it in ``eventbus_redis_refusals_total{command}`` (alert on any increase). A shard whose PEL
  recovery was refused is not read past its pending entries (`Ownership._recover`).
* ``NOGROUP`` (the group was deleted, or Redis lost its data): it is created again; every
  shard is forgotten (its PEL is claimed again when re-locked). When the shard streams are gone
  too, Redis lost its data: said once at ERROR, with where the group restarts.
* Any other error reply no `refused` names is an error reply all the same (not a missing group):
  every shard is forgotten, as after a lost reply, and the loop backs off and logs it at ERROR,
  counted under the command ``unnamed``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from logging import ERROR
from typing import TYPE_CHECKING

import anyio
from redis.exceptions import AuthenticationError, ResponseError

from eventbus.client.retry import LOST_REPLY, REDIS_ERRORS, Waits, backoff
from eventbus.errors import RedisCommandRefused
from eventbus.ops.metrics import METRICS

if TYPE_CHECKING:
    from eventbus.consumer.pipeline import Owner, Pipeline
    from eventbus.protocol.topics import TopicRegistry

log = logging.getLogger("eventbus.consumer")


@contextlib.contextmanager
def refused(command: str, key: str) -> Iterator[None]:
    """Turn an error reply to `command` into `RedisCommandRefused` naming it (NOGROUP stays
    itself: the read loop creates the group again)."""
    try:
        yield
    except ResponseError as exc:
        if "NOGROUP" in str(exc):
            raise
        raise RedisCommandRefused(command, key, f"{type(exc).__name__}: {exc}") from exc


async def start_when_reachable(
    start: Callable[[], Awaitable[None]], stop: anyio.Event, waits: Waits, who: str
) -> bool:
    """``await start()`` until it succeeds (True) or `stop` is set first (False), retrying a lost
    connection (`LOST_REPLY`) after `waits`' backoff, logged at WARNING with the error and `who`.
    Raises anything else at once: an error reply (NOPERM under an ACL...), a refused password
    (`AuthenticationError`), `ShardCountMismatch`: waiting would not fix them."""
    while not stop.is_set():
        try:
            await start()
            return True
        except AuthenticationError:
            raise
        except LOST_REPLY as exc:
            await waits.wait(stop, f"{who} cannot start: Redis unavailable", exc)
    return False


async def read_loop(pipe: Pipeline, own: Owner, registry: TopicRegistry, stop: anyio.Event) -> None:
    """Run `pipe`'s rounds (on the shards `own` holds: a group's `Ownership`, or a broadcast's
    open one) until `stop` is set, waiting while `max_in_flight` entries are unfinished, with an
    adaptive BLOCK (doubling from `block_min_ms` to `block_max_ms` while nothing arrives), and
    `read_linger_ms` after a read that got entries but filled no shard's `read_count`.
    `registry` writes the topic again after Redis lost it."""
    settings, acks, who = pipe.settings, pipe.acks, own.consumer_id
    waits = Waits(backoff(settings.retry_base_s, settings.retry_max_s), log)
    block = settings.block_min_ms
    said = False  # the data loss of this incident was reported
    while not stop.is_set():
        while acks.in_flight >= settings.max_in_flight and not stop.is_set():
            pipe.held_back = True
            await own.table.changed()
        if stop.is_set():
            break
        try:
            got = await pipe.round(block)
            waits.ok()
            said = False
        except LOST_REPLY as exc:  # the round may have half happened: start over from the PELs
            own.drop_all(f"connection error during a round: {exc}", lease=False)
            await waits.wait(stop, f"consumer {who}: Redis unavailable", exc)
            continue
        except RedisCommandRefused as exc:
            own.on_refused(exc.command)
            await waits.wait(stop, f"consumer {who}: {exc.command} refused", exc, level=ERROR)
            continue
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):  # a reply no `refused` names: never taken for NOGROUP
                own.drop_all(f"error reply during a round: {exc}", lease=False)
                own.on_refused("unnamed")
                await waits.wait(stop, f"consumer {who}: error reply", exc, level=ERROR)
                continue
            own.drop_all(f"its consumer group is missing ({exc})", lease=False)
            try:
                vanished = await pipe.reader.regroup()
                if vanished:  # the registry went with them: write the topic again (or refuse)
                    await registry.verify(own.topic)
            except REDIS_ERRORS as again:
                await waits.wait(stop, f"consumer {who}: group missing", again)
                continue
            if vanished and not said:
                said = True
                log.error(
                    "consumer %s: the shard streams %s of topic %s and the consumer group %s "
                    "vanished: Redis lost its data (FLUSHALL, a restart without persistence, a "
                    "failover to an empty replica?). The group is created again at the start of "
                    "the new streams, so "
                    "every event published from now on is handled; events published before the "
                    "loss are gone from Redis (the durable tier has what it archived), and the "
                    "shards' fencing tokens start again from 1",
                    who,
                    vanished,
                    own.topic.name,
                    own.group,
                )
            elif not vanished:
                log.warning("consumer %s: group missing (%s); created again", who, exc)
            continue
        block = settings.block_min_ms if got else min(block * 2, settings.block_max_ms)
        if got and settings.read_linger_ms and not pipe.read_full:  # let more entries arrive
            with anyio.move_on_after(settings.read_linger_ms / 1000):
                await stop.wait()


def count_refusals(topic: str, group: str) -> Callable[[str], None]:
    """``count(command)``: one more refusal of `command` in
    ``eventbus_redis_refusals_total{topic, group, command}``."""

    def count(command: str) -> None:
        METRICS.redis_refusals.labels(topic, group, command).inc()

    return count


def report_unusable(
    who: str,
    topic: str,
    unusable: dict[int, str],
    reported: set[int],
    on_refused: Callable[[str], None],
) -> set[int]:
    """Say, once per shard (not per round) until its lock key can be read again, that a shard
    of `topic` is not handled by consumer `who` because the lock script could not read its lock
    key (a Verse lock key of another type: `LockRound.unusable`); counted as a refused
    ``EVALSHA lock_shards`` (`on_refused`). The other shards are handled as usual. `reported`:
    the shards said so far; returns those of `unusable` (the next call's `reported`)."""
    for s in sorted(unusable.keys() - reported):
        log.error(
            "consumer %s: shard %d of topic %r is not handled: its lock key is unusable "
            "(%s); delete or repair the key and the shard is taken in the next lock round",
            who,
            s,
            topic,
            unusable[s],
        )
        on_refused("EVALSHA lock_shards")
    for s in sorted(reported - unusable.keys()):
        log.warning("consumer %s: shard %d's lock key is usable again", who, s)
    return set(unusable)
