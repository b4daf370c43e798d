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

import gc
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import anyio.to_thread
from pydantic import BaseModel, TypeAdapter
from redis.asyncio.retry import Retry

from eventbus.client import retry as retrying
from eventbus.consumer.context import Context, HandlerCall, Subscription
from eventbus.consumer.delivery import (
    NOT_STARTED,
    Delivery,
    Fence,
    NotStarted,
    Outcome,
    Step,
    Tally,
)
from eventbus.consumer.failures import Failures
from eventbus.consumer.routing import Router
from eventbus.consumer.watchdog import Slot, Watchdog
from eventbus.dlq import is_control
from eventbus.errors import DecodeError, HandlerTimeout, InvalidReply, UnknownEventType
from eventbus.locking.member import Member
from eventbus.ops import hooks
from eventbus.ops.metrics import METRICS, Observations
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    FORMAT_MSGPACK,
    RESERVED_TYPE_PREFIX,
    THREAD_DECODE_BYTES,
    Envelope,
    decode_entry,
    decompressed_size,
)
from eventbus.protocol.dictionaries import (
    CACHE,
    FORMAT_MSGPACK_ZSTD_DICT,
    Dictionaries,
    dictionary_id,
)
from eventbus.request import reply_stream, send_reply

log = logging.getLogger("eventbus.consumer")

T = TypeVar("T")


class FailurePolicy(Protocol):
    """What happens to entries that cannot be handled (`Failures`: dead letters, parked
    resources, the operator's control entries; a broadcast consumer's: dropped and logged)."""

    def gives_up(self, parking: bool) -> str:
        """What is done with an entry whose attempts are spent (for the log line)."""
        ...

    async def dead_letter(
        self, d: Delivery, exc: BaseException | None, *, reason: str, fence: Fence
    ) -> Outcome: ...

    async def dead_letter_and_park(
        self, d: Delivery, exc: BaseException, resource_id: str, fence: Fence
    ) -> Outcome: ...

    async def control(self, d: Delivery, fence: Fence, handling: Handling) -> Outcome: ...

    parked: dict[str, str]
    """Resources parked in the shards held (empty most of the time): resource ID -> the ID of
    its first parked dead letter."""

    def is_parked(self, resource_id: str) -> bool: ...

    async def load_parked(self) -> None: ...


_FLUSH_AT = 4096  # observations kept before they are added to the histograms regardless
_SKIPPED_TYPES = 100  # unknown types remembered (and warned about once each) per subscription


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
        (default: `Failures`, dead letters and parking; a broadcast drops them instead)."""
        self.member = member
        self.redis, self.keys, self.consumer_id = member.redis, member.keys, member.consumer_id
        self.sub = sub
        self._topic, self._group = sub.topic.name, sub.group
        self.retry = retry
        self.tally = Tally()
        self.watchdog = Watchdog(sub.handler_timeout_s)  # run by whoever runs this handling
        self.failures: FailurePolicy = (
            failures(self.tally) if failures else Failures(member, sub, retry, self.tally)
        )
        self.dictionaries = Dictionaries(member.redis, member.keys)
        self.max_decoded_bytes = member.settings.max_decompressed_bytes
        self.dedup_s = math.ceil(sub.dedup_window_s) if sub.dedup_window_s else 0
        labels = (sub.topic.name, sub.group)
        self._m_failures = METRICS.failures.labels(*labels)
        self._m_timeouts = METRICS.handler_timeouts.labels(*labels)
        self.latencies = Observations(METRICS.latency.labels(*labels))
        self._m_skipped = METRICS.skipped_unknown.labels(*labels)
        self._skipped_types: set[str] = set()  # at most _SKIPPED_TYPES
        self._skipped_more = 0  # entries of other unknown types since the last WARNING
        self._next_skip_warning = 0.0
        self.durations = Observations(METRICS.handler_duration.labels(*labels, sub.name))
        self._adapters: dict[type[BaseModel], TypeAdapter[Any]] = {}

    def prepare(self, batch: Sequence[Delivery]) -> None:
        """Decode and validate the entries of one read ahead of their turn, in one pass: each
        envelope (`decode_entry`), then the payloads of each model in one
        ``TypeAdapter(list[Model])`` call, about half the cost per event of a `model_validate`
        each (a list that does not validate is validated again entry by entry, so that each
        entry gets its own error). Sets `Delivery.env`, `event` and `call`, or `error`; leaves
        control entries, large entries (decoded in a thread at their turn) and entries whose
        dictionary is not loaded yet to `step`, which decodes them as before. Raises nothing."""
        routes = self.sub.routes
        by_type, fallback = routes.by_type, routes.fallback
        limit = self.max_decoded_bytes
        pending: dict[type[BaseModel], list[Delivery]] = {}
        for d in batch:
            fields = d.fields
            data = fields.get(F_DATA)
            if not data:
                continue
            plain = data[0] == FORMAT_MSGPACK and len(data) < THREAD_DECODE_BYTES
            if not plain and not _decodes_now(data):
                continue
            try:
                env = decode_entry(fields, max_bytes=limit)
            except DecodeError as exc:
                d.error = exc
                continue
            if env.event_type.startswith(RESERVED_TYPE_PREFIX):  # a control entry: at its turn
                continue
            d.env = env
            if env.headers and (bad := self._bad_request(env)) is not None:
                d.error = bad
                continue
            route = by_type.get(env.event_type, fallback)
            if route is None:
                d.error = self._unknown(env.event_type)
            elif route.model is not None:
                d.call = route.call
                pending.setdefault(route.model, []).append(d)
            else:
                d.call = route.call
                try:
                    d.event = route.convert(env.payload)
                except DecodeError as exc:
                    d.error = exc
        for model, ds in pending.items():
            adapter = self._adapters.get(model)
            if adapter is None:
                adapter = self._adapters[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
            try:
                events = adapter.validate_python([d.env.payload for d in ds])  # type: ignore[union-attr]
            except Exception:  # find which entries do not validate, and why
                convert = routes.get(ds[0].env.event_type).convert  # type: ignore[union-attr]
                for d in ds:
                    try:
                        d.event = convert(d.env.payload)  # type: ignore[union-attr]
                    except DecodeError as exc:
                        d.error = exc
            else:
                for d, event in zip(ds, events, strict=True):
                    d.event = event

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
                d.error = self._bad_request(d.env)
        if d.error is not None:  # logged at WARNING by the dead-letter write
            bad = d.error
            if isinstance(bad, UnknownEventType) and self.sub.routes.on_unknown == "skip":
                self._skip(bad.event_type)
                return Outcome.ACK
            return await self.failures.dead_letter(d, bad, reason="undecodable", fence=fence)
        env, event = d.env, d.event
        assert env is not None
        if self.dedup_s and await self._seen(env.event_id_bytes):
            self.tally.duplicates_skipped += 1
            return Outcome.ACK
        d.attempt += 1
        error = await self.attempt(d, env, event, fence, d.entry_id, d.attempt, slot)
        if error is NOT_STARTED:  # the lease ran out while decoding: wait for it again
            d.attempt -= 1
            return 0.0
        if error is None:
            if self.dedup_s:
                await self._mark_seen(env.event_id_bytes)
            return Outcome.ACK
        return await self.failed(d, env, error, fence)

    def fast(self, d: Delivery) -> bool:
        """Whether `d` needs nothing but its handler call before it is acked: decoded and
        validated ahead of its turn, no parked resource to look up and no de-duplication
        (`QueueRunner.run` then calls `attempt` itself, inlining this test; `step` does the
        rest)."""
        return d.event is not None and not self.dedup_s and not self.failures.parked

    async def failed(self, d: Delivery, env: Envelope, error: Exception, fence: Fence) -> Step:
        """After attempt `d.attempt` failed with `error`: the delay before the next one, or,
        once the subscription's attempts are spent, the dead letter (and the park)."""
        delay = self.retry_delay(d, env, error)
        if delay is not None:
            return delay
        parking = self.sub.on_failure == "park"
        self.gave_up(d, env, error, self.failures.gives_up(parking))
        if parking:
            return await self.failures.dead_letter_and_park(d, error, env.resource_id, fence)
        return await self.failures.dead_letter(d, error, reason="failed", fence=fence)

    def retry_delay(
        self, d: Delivery, env: Envelope, error: Exception, what: str = "handler"
    ) -> float | None:
        """After failed attempt `d.attempt`: the delay (s) before the next one, logged at
        WARNING with the traceback, or None when the subscription's attempts are spent."""
        policy = self.sub.retry
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

    async def decoded(self, fields: dict[bytes, bytes]) -> tuple[Envelope, Any]:
        """`decode`, on the event loop for a small entry, in a worker thread for a large one
        (`_large`): decompressing, unpacking and validating it can take seconds, and the loop
        must go on refreshing the lease meanwhile. Raises `DecodeError` like `decode`."""
        data = fields.get(F_DATA)
        if data and data[0] == FORMAT_MSGPACK_ZSTD_DICT:  # its dictionary, from Redis once
            topic = self.sub.topic.name  # a connection error is retried, not a dead letter
            await retrying.call(
                self.retry, "dictionary load", lambda: self.dictionaries.ensure(topic, data)
            )
        if not _large(fields):
            return self.decode(fields)
        return await anyio.to_thread.run_sync(_without_gc, self.decode, fields)

    async def envelope(self, fields: dict[bytes, bytes]) -> Envelope:
        """The entry's envelope alone (control entries), bounded and off the loop like
        `decoded`. Raises `DecodeError`."""
        if not _large(fields):
            return self._envelope(fields)
        return await anyio.to_thread.run_sync(_without_gc, self._envelope, fields)

    def _envelope(self, fields: dict[bytes, bytes]) -> Envelope:
        return decode_entry(fields, max_bytes=self.max_decoded_bytes)

    def decode(self, fields: dict[bytes, bytes]) -> tuple[Envelope, Any]:
        """The entry's envelope and its payload validated as the subscription's model for its
        type. Raises `DecodeError` (`UnknownEventType` for a type no model names) for bad bytes,
        a missing field, or a payload the model refuses, whatever its validators raise.
        Synchronous: see `decoded`."""
        env = self._envelope(fields)
        route = self.sub.routes.get(env.event_type)
        if route is None:
            raise self._unknown(env.event_type)
        return env, route.convert(env.payload)

    def _bad_request(self, env: Envelope) -> DecodeError | None:
        """Why `env` is a request whose reply could never be sent (a reply stream that is not
        one of eventbus's), or None: found before the handler runs, such a request is
        dead-lettered at once instead of running the handler `max_attempts` times."""
        try:
            reply_stream(self.keys, env.headers)
        except InvalidReply as exc:
            return DecodeError(f"request with a bad reply address: {exc}")
        return None

    def _unknown(self, event_type: str) -> UnknownEventType:
        return UnknownEventType(
            f"event type {event_type!r} is not handled by {self.sub.name} "
            f"(expects {self.sub.routes.expects()})",
            event_type=event_type,
        )

    def _name(self, event_type: str) -> str:
        """The name of the handler `event_type` is routed to (for logs)."""
        route = self.sub.routes.get(event_type)
        return route.call.name if route is not None else self.sub.name

    def _skip(self, event_type: str) -> None:
        """An entry of a type no handler takes, with ``on_unknown="skip"``: counted, and a
        WARNING the first time each of the first `_SKIPPED_TYPES` types is skipped (not per
        entry: a producer's new type would flood the log); past that many types, one WARNING
        a minute at most, with how many entries were skipped since (a producer writing random
        types must neither flood the log nor grow this set without bound)."""
        self._m_skipped.inc()
        if event_type in self._skipped_types:
            return
        if len(self._skipped_types) < _SKIPPED_TYPES:
            self._skipped_types.add(event_type)
            log.warning(
                "group %s of topic %s skips events of type %r: no handler takes them "
                "(on_unknown='skip'; counted in eventbus_skipped_unknown_total)",
                self.sub.group,
                self.sub.topic.name,
                event_type,
            )
            return
        self._skipped_more += 1
        now = time.monotonic()
        if now >= self._next_skip_warning:
            self._next_skip_warning = now + 60.0
            log.warning(
                "group %s of topic %s skipped %d more events of types no handler takes, beyond "
                "the first %d types (e.g. %r); counted in eventbus_skipped_unknown_total",
                self.sub.group,
                self.sub.topic.name,
                self._skipped_more,
                _SKIPPED_TYPES,
                event_type,
            )
            self._skipped_more = 0

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
        to the reply stream the entry's headers name (`eventbus.request.send_reply`)."""
        call = self.sub.call  # maybe wrapped (eventbus.testing records the calls through it)
        if type(call) is Router and d.call is not None:
            call = d.call  # the routed handler, found by `prepare`: no second lookup
        plain = type(call) is HandlerCall and call.direct and hooks.tracing is None
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
        elif hooks.tracing is not None:
            coro = hooks.tracing.consume(call, event, ctx)  # type: ignore[arg-type]
        else:
            coro = call(event, ctx)  # type: ignore[arg-type]
        # the handler call under the watchdog, as `watched` does, without its coroutine
        slot = slot or self.watchdog.slot()
        started = slot.started = time.monotonic()
        error: Exception | None = None
        result: Any = None
        try:
            result = await coro
        except BaseException as exc:
            error = self._failure(slot, exc)
        else:
            if slot.fired:  # a handler that swallowed the cancellation ran to its end
                slot.timed_out()
        finally:
            slot.started = 0.0
            self.durations.values.append(time.monotonic() - started)
        if error is None and result is not None:  # the answer to a request (eventbus.request)
            try:
                await send_reply(self.redis, self.keys, env, result)
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
        cancelled it past `handler_timeout_s`), counted as a failure; records its duration.
        (`attempt` does the same inline: a coroutine less per event.)"""
        started = slot.started = time.monotonic()
        try:
            result = await call
        except BaseException as exc:
            return None, self._failure(slot, exc)
        else:
            slot.timed_out()  # a handler that swallowed the cancellation ran to its end
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
        timeout = self.sub.handler_timeout_s
        assert timeout is not None
        return HandlerTimeout(self.sub.name, timeout, abandoned=not self.sub.call.is_async)

    # -- de-duplication (optional) ----------------------------------------------------------------
    async def _seen(self, event_id: bytes) -> bool:
        key = self.keys.dedup(self.sub.topic.name, self.sub.group, event_id)
        return bool(await retrying.call(self.retry, "dedup check", lambda: self.redis.exists(key)))

    async def _mark_seen(self, event_id: bytes) -> None:
        key = self.keys.dedup(self.sub.topic.name, self.sub.group, event_id)
        await retrying.call(
            self.retry, "dedup mark", lambda: self.redis.set(key, b"1", ex=self.dedup_s)
        )


def _decodes_now(data: bytes) -> bool:
    """Whether an entry with this ``data`` field decodes on the event loop without waiting: not
    large (`_large`), and its dictionary (if it has one) already loaded."""
    if data[0] == FORMAT_MSGPACK:
        return len(data) < THREAD_DECODE_BYTES
    if data[0] == FORMAT_MSGPACK_ZSTD_DICT and dictionary_id(data) not in CACHE:
        return False
    return not _large({F_DATA: data})


def _large(fields: dict[bytes, bytes]) -> bool:
    """Whether an entry's data field, or its body once decompressed, is at least
    `THREAD_DECODE_BYTES` (a zstd frame that does not declare its size counts as large): a
    decompression bomb is small until it is decompressed. Reads the frame header only."""
    data = fields.get(F_DATA, b"")
    if len(data) >= THREAD_DECODE_BYTES:
        return True
    size = decompressed_size(data)
    return size < 0 or size >= THREAD_DECODE_BYTES


_gc_lock = threading.Lock()
_gc_pausers = 0  # threads decoding with the cyclic garbage collector paused
_gc_paused_by_us = False


def _without_gc(decode: Callable[[dict[bytes, bytes]], T], fields: dict[bytes, bytes]) -> T:
    """``decode(fields)`` with Python's cyclic garbage collector paused (in a worker thread).

    Unpacking builds up to a few million containers; every collection the allocations trigger
    walks them all while holding the GIL, which stops the event loop (heartbeats) for as long:
    seconds for a body at the container budget, against about 0.1 s with the collector paused.
    Reference counting still frees everything; the collector resumes when the last concurrent
    decode ends (unless the application had disabled it itself)."""
    global _gc_pausers, _gc_paused_by_us
    with _gc_lock:
        if _gc_pausers == 0 and gc.isenabled():
            gc.disable()
            _gc_paused_by_us = True
        _gc_pausers += 1
    try:
        return decode(fields)
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_paused_by_us:
                _gc_paused_by_us = False
                gc.enable()
