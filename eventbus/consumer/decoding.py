"""Decoding a subscription's entries: envelopes, routes and validated events, per read.

`Decoding.prepare` decodes and validates the entries of one read ahead of their turn, in one
pass (the consumer, broadcast and catch-up call it); `decoded` is the per-entry path of what
`prepare` leaves to the entry's turn (a large entry in a worker thread, a dictionary to load
first), `envelope` the envelope alone (control entries). Entries of types no handler takes are
skipped or dead-lettered by the caller (`skip` keeps the warnings bounded).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread
from pydantic import BaseModel, TypeAdapter
from redis.asyncio.retry import Retry

from eventbus.client import retry as retrying
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import Delivery
from eventbus.consumer.foreign import prepare_foreign
from eventbus.errors import DecodeError, InvalidReply, UnknownEventType, undecodable
from eventbus.locking.member import Member
from eventbus.ops.metrics import METRICS
from eventbus.profiles import Codec
from eventbus.protocol.codec import (
    F_DATA,
    FORMAT_MSGPACK,
    RESERVED_TYPE_PREFIX,
    THREAD_DECODE_BYTES,
    Envelope,
    decode_entry,
)
from eventbus.protocol.dictionaries import (
    CACHE,
    DICT_FORMATS,
    Dictionaries,
    dictionary_id,
)
from eventbus.protocol.framing import decompressed_size
from eventbus.protocol.replies import reply_stream

log = logging.getLogger("eventbus.consumer")

T = TypeVar("T")
_SKIPPED_TYPES = 100  # unknown types remembered (and warned about once each) per subscription


class Decoding:
    """Decoding of `sub`'s entries for `member`; `retry` retries loading a dictionary."""

    def __init__(self, member: Member, sub: Subscription, retry: Retry) -> None:
        self.sub, self.keys, self.retry = sub, member.keys, retry
        self.dictionaries = Dictionaries(member.redis, member.keys)
        self.max_decoded_bytes = member.settings.max_decompressed_bytes
        self._adapters: dict[type[BaseModel], TypeAdapter[Any]] = {}
        self._m_skipped = METRICS.skipped_unknown.labels(sub.topic.name, sub.group)
        self._skipped_types: set[str] = set()  # at most _SKIPPED_TYPES
        self._skipped_more = 0  # entries of other unknown types since the last WARNING
        self._next_skip_warning = 0.0
        self.codec = member.profile.codec  # the format, and how a read is prepared

    def prepare(self, batch: Sequence[Delivery]) -> None:
        """Decode and validate the entries of one read ahead of their turn: each envelope
        (`decode_entry`), then `route`. Sets `Delivery.env`, `event` and `call`, or `error`;
        leaves control entries, large entries (decoded in a thread at their turn) and entries
        whose dictionary is not loaded yet to `step`, which decodes them as before. Whatever
        decoding an entry raises is that entry's `error` (`undecodable`: a dead letter naming
        it), never the read's. Raises nothing. (A wire profile's own format decodes with
        `prepare_foreign` instead: `Codec.reads`.)"""
        limit = self.max_decoded_bytes
        decoded: list[Delivery] = []
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
            except Exception as exc:  # DecodeError; anything else too (`undecodable`)
                d.error = undecodable(exc)
                continue
            if env.event_type.startswith(RESERVED_TYPE_PREFIX):  # a control entry: at its turn
                continue
            d.env = env
            decoded.append(d)
        self.route(decoded)

    def prepare_foreign(self, codec: Codec, batch: Sequence[Delivery]) -> None:
        """`prepare` for a read of a format other than eventbus's, decoded by `codec` entry by
        entry and queued per shard (`eventbus.consumer.foreign`; `Codec.reads` picks it)."""
        prepare_foreign(self, codec, batch)

    def route(self, decoded: Sequence[Delivery]) -> None:
        """Route and validate `decoded` (deliveries whose `env` is set), whatever their wire
        format: sets each one's `call` and `event`, or `error` (a bad reply address, an unknown
        type, a payload its model refuses). The payloads of each model are validated in one
        ``TypeAdapter(list[Model])`` call, about half the cost per event of a `model_validate`
        each (a list that does not validate is validated again entry by entry, so that each
        entry gets its own error). Raises nothing."""
        routes = self.sub.routes
        by_type, fallback = routes.by_type, routes.fallback
        pending: dict[type[BaseModel], list[Delivery]] = {}
        for d in decoded:
            env: Envelope = d.env  # type: ignore[assignment]  # (set: the callers' contract)
            if env.headers and (bad := self.bad_request(env)) is not None:
                d.error = bad
                continue
            route = by_type.get(env.event_type, fallback)
            if route is None:
                d.error = self.unknown(env.event_type)
            elif route.model is not None:
                d.call = route.call
                pending.setdefault(route.model, []).append(d)
            else:
                d.call = route.call
                try:
                    d.event = route.convert(env.payload)
                except Exception as exc:  # e.g. a bytes handler's payload nested too deep
                    d.error = undecodable(exc)
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
                    except Exception as exc:
                        d.error = undecodable(exc)
            else:
                for d, event in zip(ds, events, strict=True):
                    d.event = event

    async def decoded(self, fields: dict[bytes, bytes]) -> tuple[Envelope, Any]:
        """`decode`, on the event loop for a small entry, in a worker thread for a large one
        (`_large`): decompressing, unpacking and validating it can take seconds, and the loop
        must go on refreshing the lease meanwhile. Raises `DecodeError` like `decode` (for
        whatever the decode raised: `undecodable`), or the connection error that loading the
        entry's dictionary from Redis still met after its retries."""
        data = fields.get(F_DATA)
        if data and data[0] in DICT_FORMATS:  # its dictionary, from Redis once
            topic = self.sub.topic.name  # a connection error is retried, not a dead letter
            await retrying.call(
                self.retry, "dictionary load", lambda: self.dictionaries.ensure(topic, data)
            )
        return await _off_loop_if_large(self.decode, fields)

    async def envelope(self, fields: dict[bytes, bytes]) -> Envelope:
        """The entry's envelope alone (control entries), bounded and off the loop like
        `decoded`. Raises `DecodeError` (for whatever the decode raised: `undecodable`)."""
        return await _off_loop_if_large(self._envelope, fields)

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
            raise self.unknown(env.event_type)
        return env, route.convert(env.payload)

    def bad_request(self, env: Envelope) -> DecodeError | None:
        """Why `env` is a request whose reply could never be sent (a reply stream that is not
        one of eventbus's, a reply key that is not 64 hex digits), or None: found before the
        handler runs, such a request is dead-lettered at once instead of running the handler
        `max_attempts` times."""
        try:
            reply_stream(self.keys, env.headers)
        except InvalidReply as exc:
            return DecodeError(f"request that cannot be answered: {exc}")
        except Exception as exc:  # whatever the headers make it raise: this entry's error
            return undecodable(exc)
        return None

    def unknown(self, event_type: str) -> UnknownEventType:
        return UnknownEventType(
            f"event type {event_type!r} is not handled by {self.sub.name} "
            f"(expects {self.sub.routes.expects()})",
            event_type=event_type,
        )

    def skip(self, event_type: str) -> None:
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


def _decodes_now(data: bytes) -> bool:
    """Whether an entry with this ``data`` field decodes on the event loop without waiting: not
    large (`_large`), and its dictionary (if it has one) already loaded."""
    if data[0] == FORMAT_MSGPACK:
        return len(data) < THREAD_DECODE_BYTES
    if data[0] in DICT_FORMATS and dictionary_id(data) not in CACHE:
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


async def _off_loop_if_large(
    decode: Callable[[dict[bytes, bytes]], T], fields: dict[bytes, bytes]
) -> T:
    """``decode(fields)`` on the event loop for a small entry, in a worker thread for a large
    one (`_large`, `_without_gc`). Raises `DecodeError` for whatever it raised (`undecodable`)."""
    try:
        if not _large(fields):
            return decode(fields)
        return await anyio.to_thread.run_sync(_without_gc, decode, fields)
    except Exception as exc:
        raise undecodable(exc)  # noqa: B904 (its cause is `exc`: `undecodable`)


DECODE_SWITCH_INTERVAL_S = 0.0005
"""`sys.setswitchinterval` while a large entry decodes in a worker thread (Python's default is
0.005 s): how long the event loop's thread waits for the GIL each time it takes it back."""

_gc_lock = threading.Lock()
_gc_pausers = 0  # threads decoding with the cyclic garbage collector paused
_gc_paused_by_us = False
_saved_switch_interval: float | None = None  # the interpreter's, while decoders run


def _without_gc(decode: Callable[[dict[bytes, bytes]], T], fields: dict[bytes, bytes]) -> T:
    """``decode(fields)`` with Python's cyclic garbage collector paused and the GIL's switch
    interval shortened to `DECODE_SWITCH_INTERVAL_S` (in a worker thread; both process-wide).

    Unpacking builds up to a few million containers; every collection the allocations trigger
    walks them all while holding the GIL, which stops the event loop (heartbeats) for as long:
    seconds for a body at the container budget, against about 0.1 s with the collector paused.
    And while this thread computes, the loop's thread gives the GIL up at each select, send and
    recv, then waits a whole switch interval (plus the OS's wake-up) to get it back. In one
    set of alternated runs of tests/integration/test_consumer_safety.py's bomb on a loaded
    machine (2 cores, load ~7), the loop's longest stall was 0.15-0.65 s at 5 ms, 0.07-0.21 s
    at 0.5 ms; with CPU hogs alone both stayed under 0.17 s. Reference counting
    still frees everything; both settings are restored when the last concurrent decode ends
    (the collector only if the application had not disabled it itself)."""
    global _gc_pausers, _gc_paused_by_us, _saved_switch_interval
    with _gc_lock:
        if _gc_pausers == 0:
            _saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved_switch_interval, DECODE_SWITCH_INTERVAL_S))
            if gc.isenabled():
                gc.disable()
                _gc_paused_by_us = True
        _gc_pausers += 1
    try:
        return decode(fields)
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0:
                if _saved_switch_interval is not None:
                    sys.setswitchinterval(_saved_switch_interval)
                    _saved_switch_interval = None
                if _gc_paused_by_us:
                    _gc_paused_by_us = False
                    gc.enable()
