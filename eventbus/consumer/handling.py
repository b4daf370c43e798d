"""The one handling path of an entry, shared by the live consumer and by catch-up.

`Handling.step` takes the entry at the head of its resource's queue one step further: control
entry (operator's unpark/drop), parked resource, decode and validate, de-duplication, one
handler attempt, then the failure policy (retry after a delay, or dead-letter and maybe park).
It returns an `Outcome` (ack it, or let it go unacked) or the delay in seconds before the next
attempt. Who calls it decides how to wait (the live consumer sets a timer so the resource does
not hold a worker; catch-up waits in place) and how to ack.

Fencing: the caller passes a `Fence`. No handler starts unless `Fence.holds` says, right before
the call with no await in between, that the lease is valid and the entry's shard is still held by
the same lock acquisition (a process paused while decoding must not start a handler with a
superseded token when it wakes: found by the chaos harness).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, cast

import anyio
from redis.asyncio.retry import Retry

from eventbus.consumer.context import Context, HandlerCall, Subscription
from eventbus.consumer.decoding import Decoding
from eventbus.consumer.dedup import Dedup
from eventbus.consumer.delivery import (
    NOT_STARTED,
    Delivery,
    FailurePolicy,
    Fence,
    NotStarted,
    Outcome,
    Step,
    Tally,
)
from eventbus.consumer.failures import Failures
from eventbus.consumer.routing import Router
from eventbus.consumer.scope import around
from eventbus.consumer.watchdog import Slot, Watchdog
from eventbus.errors import DecodeError, HandlerTimeout, UnknownEventType
from eventbus.locking.member import Member
from eventbus.ops import hooks
from eventbus.ops.metrics import METRICS, Observations
from eventbus.protocol.codec import F_RESOURCE, Envelope
from eventbus.protocol.dead_letters import is_control
from eventbus.protocol.replies import send_reply

log = logging.getLogger("eventbus.consumer")


_FLUSH_AT = 4096  # observations kept before they are added to the histograms regardless


class Handling:
    """Decode, handle and apply the failure policy for the entries of `sub`, on behalf of
    `member` (its ID is shown to handlers in `Context.consumer_id`); `retry` is the Redis retry
    used for the policy's own Redis calls (dead letters, parking, de-duplication).
    """

    def __init__(
        self,
        member: Member,
        sub: Subscription,
        retry: Retry,
        failures: Callable[[Tally], FailurePolicy] | None = None,
    ) -> None:
        """`failures` makes the policy for entries that cannot be handled from the tally
        (default: `Failures` without fencing, dead letters and parking; a group consumer's are
        fenced by its ownership, a broadcast drops them instead)."""
        self.member = member
        self.redis, self.keys, self.consumer_id = member.redis, member.keys, member.consumer_id
        self.sub = sub
        self._topic, self._group = sub.topic.name, sub.group
        self.retry = retry
        self.tally = Tally()
        self.watchdog = Watchdog(sub.options.handler_timeout_s)  # run by whoever runs this handling
        self.stopping = anyio.Event()
        """Set by whoever runs this handling when it stops: retry waits end (`wait_retry`)."""
        self.halting = anyio.Event()
        """Set when the consumer stops reading (with `stopping`, or before it: an at-most-once
        consumer handles what it read first): a catch-up from the archive stops there."""
        self.decoding = Decoding(member, sub, retry)
        # the decoding path, under the names the consumer, broadcast and catch-up call; the
        # profile's codec picks how a read is prepared (`Codec.reads`)
        self.prepare: Callable[[Sequence[Delivery]], None] = self.decoding.codec.reads(
            self.decoding
        )
        self.decoded = self.decoding.decoded
        self.envelope, self.decode = self.decoding.envelope, self.decoding.decode
        self.failures: FailurePolicy = (failures or partial(Failures, member, sub, retry))(
            self.tally
        )
        self.dedup = Dedup(member, sub, retry)
        self.dedup_s = self.dedup.window_s  # 0: none (read per entry by `QueueRunner.run`)
        self.scope = sub.scope
        self.middlewares = tuple(sub.scope.middlewares)  # those registered when it starts
        labels = (sub.topic.name, sub.group)
        self._m_failures = METRICS.failures.labels(*labels)
        self._m_timeouts = METRICS.handler_timeouts.labels(*labels)
        self.latencies = Observations(METRICS.latency.labels(*labels))
        self.durations = Observations(METRICS.handler_duration.labels(*labels, sub.name))

    async def step(self, d: Delivery, fence: Fence, slot: Slot | None = None) -> Step:
        """One step for `d`, the head of its resource's queue; see the module docstring.
        `slot` is the calling worker's watchdog slot (looked up when not given)."""
        if not fence.holds(d) and not await fence.wait(d):
            return Outcome.LET_GO
        prepared = d.env is not None or d.error is not None
        if not prepared and is_control(d.fields):
            return await self.failures.control(d, fence, self)
        if self.failures.parked:
            rid = d.fields.get(F_RESOURCE)
            if rid is not None and self.failures.is_parked(rid.decode("utf-8", "replace")):
                return await self.failures.dead_letter(d, None, reason="parked", fence=fence)
        if not prepared:
            try:
                d.env, d.event = await self.decoded(d.fields)
            except DecodeError as exc:
                d.error = exc
            else:
                d.error = self.decoding.bad_request(d.env)
        if d.error is not None:  # logged at WARNING by the dead-letter write
            bad = d.error
            if isinstance(bad, UnknownEventType) and self.sub.options.on_unknown == "skip":
                self.decoding.skip(bad.event_type)
                return Outcome.ACK
            return await self.failures.dead_letter(d, bad, reason="undecodable", fence=fence)
        env, event = d.env, d.event
        assert env is not None
        if self.dedup_s and await self.dedup.seen(env.event_id_bytes):
            self.tally.duplicates_skipped += 1
            return Outcome.ACK
        d.attempt += 1
        error = await self.attempt(d, env, event, fence, d.entry_id, d.attempt, slot)
        if error is NOT_STARTED:  # the lease ran out while decoding: wait for it again
            d.attempt -= 1
            return 0.0
        if error is None:
            if self.dedup_s:
                await self.dedup.mark(env.event_id_bytes)
            return Outcome.ACK
        return await self.failed(d, env, error, fence)

    async def failed(self, d: Delivery, env: Envelope, error: Exception, fence: Fence) -> Step:
        """After attempt `d.attempt` failed with `error`: the delay before the next one, or,
        once the subscription's attempts are spent, the dead letter (and the park)."""
        delay = self.retry_delay(d, env, error)
        if delay is not None:
            return delay
        parking = self.sub.options.on_failure == "park"
        self.gave_up(d, env, error, self.failures.gives_up(parking))
        if parking:
            return await self.failures.dead_letter_and_park(d, error, env.resource_id, fence)
        return await self.failures.dead_letter(d, error, reason="failed", fence=fence)

    def retry_delay(
        self, d: Delivery, env: Envelope, error: Exception, what: str = "handler"
    ) -> float | None:
        """After failed attempt `d.attempt`: the delay (s) before the next one, logged at
        WARNING with the traceback, or None when the subscription's attempts are spent."""
        policy = self.sub.options.retry
        if d.attempt >= policy.max_attempts:
            return None
        delay = policy.delay_s(d.attempt)
        log.warning(
            "%s %s failed on shard %d entry %s (attempt %d/%d): %r; retry in %.2f s",
            what,
            self._name(env.event_type),
            d.shard,
            d.entry_id.decode(),
            d.attempt,
            policy.max_attempts,
            error,
            delay,
            exc_info=error,
        )
        return delay

    def context(self, d: Delivery, env: Envelope, entry_id: bytes, attempt: int) -> Context:
        """The `Context` a handler gets for attempt `attempt` on `env`, entry `entry_id`, under
        `d`'s shard and token."""
        # positional: half the cost of keywords (Context's field order is part of its API)
        return Context(
            self._topic,
            self._group,
            d.shard,
            entry_id.decode(),
            env.resource_id,
            env.event_id_bytes,
            env.event_type,
            env.published_at_ms,
            env.headers,
            attempt,
            d.token,
            self.consumer_id,
            d.delivery_count,
            self.scope,
        )

    def gave_up(
        self, d: Delivery, env: Envelope, error: Exception, then: str, what: str = "handler"
    ) -> None:
        """Log at ERROR, with the traceback, that the last attempt `d.attempt` failed with
        `error` and what is done with the entry now (`then`)."""
        log.error(
            "%s %s failed %d times on shard %d entry %s: %r; %s",
            what,
            self._name(env.event_type),
            d.attempt,
            d.shard,
            d.entry_id.decode(),
            error,
            then,
            exc_info=error,
        )

    def _name(self, event_type: str) -> str:
        """The name of the handler `event_type` is routed to (for logs)."""
        route = self.sub.routes.get(event_type)
        return route.call.name if route is not None else self.sub.name

    async def attempt(
        self,
        d: Delivery,
        env: Envelope,
        event: Any,
        fence: Fence,
        entry_id: bytes,
        attempt: int,
        slot: Slot | None = None,
    ) -> Exception | NotStarted | None:
        """Run the handler once on `event` (entry `entry_id`, attempt number `attempt`) under
        `d`'s shard and token. Returns its exception (`HandlerTimeout` past the subscription's
        `handler_timeout_s`), None on success, or `NOT_STARTED` when the fence no longer holds
        (then nothing ran). A non-None return value of the handler answers a request: it goes
        to the reply stream the entry's headers name (`eventbus.protocol.replies.send_reply`)."""
        call = self.sub.call  # maybe wrapped (eventbus.testing records the calls through it)
        if type(call) is Router and d.call is not None:
            call = d.call  # the routed handler, found by `prepare`: no second lookup
        middlewares = self.middlewares
        plain = (
            type(call) is HandlerCall and call.direct and hooks.tracing is None and not middlewares
        )
        # a Context only for whoever reads it: the handler, a wrapper, the tracing hook
        ctx = self.context(d, env, entry_id, attempt) if call.takes_context or not plain else None
        # Checked last, with no await before the call: a process stopped after this check and
        # before the handler's first line still runs it with a superseded token when it wakes
        # (stress FINDINGS 7: the downstream store's check of the fencing token is what refuses
        # its writes).
        if not fence.holds(d):
            return NOT_STARTED
        coro: Awaitable[Any]
        if plain:  # its coroutine function itself: one coroutine fewer per event
            coro = call.func(event, ctx) if ctx is not None else call.func(event)
        elif middlewares:
            traced = hooks.tracing
            inner = call if traced is None else partial(traced.consume, call)
            coro = around(middlewares, inner, event, ctx)
        elif hooks.tracing is not None:
            coro = hooks.tracing.consume(call, event, ctx)  # type: ignore[arg-type]
        else:
            coro = call(event, ctx)  # type: ignore[arg-type]
        result, error = await self.watched(slot or self.watchdog.slot(), coro)
        if error is None and result is not None:  # the answer to a request (eventbus.request)
            try:
                await send_reply(
                    self.redis, self.keys, self._topic, d.shard, entry_id.decode(), env, result
                )
            except Exception as exc:
                self._m_failures.inc()
                error = exc
        if error is not None:
            return error
        self.tally.handled += 1
        latencies = self.latencies.values
        latency = time.time() - env.published_at_ms * 0.001
        latencies.append(latency if latency > 0.0 else 0.0)  # (clocks of two machines)
        if len(latencies) >= _FLUSH_AT:
            self.flush_metrics()
        return None

    async def watched(self, slot: Slot, call: Awaitable[Any]) -> tuple[Any, Exception | None]:
        """Await a handler call under the watchdog (`slot` is the calling worker's; no cancel
        scope per call: one with a deadline cost 6-12 us, `eventbus.consumer.watchdog`). Returns
        its result and None, or None and what it raised (`HandlerTimeout` when the watchdog
        cancelled it past `handler_timeout_s`), counted as a failure; records its duration."""
        started = slot.started = time.monotonic()
        try:
            result = await call
        except BaseException as exc:
            return None, self._failure(slot, exc)
        else:
            if slot.fired:  # a handler that swallowed the cancellation ran to its end
                slot.timed_out()
            return result, None
        finally:
            slot.started = 0.0
            self.durations.values.append(time.monotonic() - started)

    def _failure(self, slot: Slot, exc: BaseException) -> Exception:
        """What a handler call that raised `exc` failed with, counted: `HandlerTimeout` when the
        watchdog cancelled it, else `exc`. Re-raises a cancellation that is not the watchdog's
        (shutdown) and whatever is not an `Exception`."""
        timed_out = slot.timed_out()
        if not timed_out and not isinstance(exc, Exception):
            raise exc
        error = self.timeout_error() if timed_out else cast(Exception, exc)
        self._m_failures.inc()
        if timed_out:
            self._m_timeouts.inc()
        return error

    def flush_metrics(self) -> None:
        """Add the latencies and handler durations observed since the last call to their
        histograms (once per read round: see `eventbus.ops.metrics.Observations`)."""
        self.latencies.flush()
        self.durations.flush()

    def timeout_error(self) -> HandlerTimeout:
        """What an attempt cancelled by the watchdog failed with (`handler_timeout_s`)."""
        timeout = self.sub.options.handler_timeout_s
        assert timeout is not None
        return HandlerTimeout(self.sub.name, timeout, abandoned=not self.sub.call.is_async)
