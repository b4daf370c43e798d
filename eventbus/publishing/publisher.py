"""Publishing: event -> envelope -> ``XADD <shard stream> MAXLEN ~ <cap> * rid .. type .. data ..``.

Concurrent `publish()` calls are coalesced into pipelines and land in call order
(`eventbus.publishing.sending`): while one pipeline is on the wire, new calls queue up, and the next
pipeline carries all of them (up to `publish_batch_max`). No caller has to batch by hand, and a
lone call is sent at once. This needs the bus to be running (the flusher task lives in the bus's
task group); outside a running bus each call is sent on its own. XADD with ``MAXLEN ~`` trims
whole macro nodes only, so the cap is approximate
(https://redis.io/docs/latest/commands/xadd/#capped-streams).

Connection errors are retried with exponential backoff until `publish_timeout_s`; after that the
call raises `PublishError`. `publish_timeout_s` is a deadline on the caller: `publish()` returns or
raises within it even when Redis stops answering mid-call (a stopped process, a partition without
RST), and each pipeline is abandoned at that deadline too (its connection closed), so neither the
flusher nor `publish_many` waits on a silent server for longer. An XADD whose reply was lost may
have been applied, so a retry can store an event twice: both copies carry the same event ID, for
consumers to de-duplicate.

What every consumer would refuse is refused here, before anything is sent: reserved event types
(``__eventbus.``, `ReservedEventType`), headers that are not str -> str and resource IDs that are
not valid UTF-8 (`InvalidEvent`), entries over `max_payload_bytes` (`PayloadTooLarge`) and
envelopes that decompress to more than `Settings.max_decompressed_bytes`
(`DecompressedTooLarge`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, NotRequired, TypedDict

import anyio
from pydantic import BaseModel

from eventbus.config import Settings
from eventbus.errors import (
    ConfigError,
    DecodeError,
    DecompressedTooLarge,
    InvalidEvent,
    PayloadTooLarge,
    PublishError,
    ReservedEventType,
)
from eventbus.locking.member import AsyncRedis
from eventbus.ops import hooks
from eventbus.profiles import EVENTBUS, WireProfile
from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    FORMAT_MSGPACK,
    RESERVED_TYPE_PREFIX,
    Envelope,
    decode_entry,
    decompressed_size,
    encode_entry,
    envelope_of,
)
from eventbus.protocol.dictionaries import Dictionaries
from eventbus.protocol.keys import Keys, check_event_type
from eventbus.protocol.topics import TopicConfig, TopicRegistry
from eventbus.publishing.foreign import encode_foreign as _encode_foreign
from eventbus.publishing.sending import Sender
from eventbus.publishing.topic_setup import TopicSetup

log = logging.getLogger("eventbus.publisher")
_TYPES_KEPT = 10_000  # event type names a publisher remembers as checked
_FIELD_NAME_BYTES = len(F_RESOURCE) + len(F_TYPE) + len(F_DATA)  # `encoded_size`'s share of names


class PublishOptions(TypedDict):
    """The keyword arguments of ``EventBus.publish(topic, event, **options)``, as the methods
    that pass them on take them (``SyncBus.publish``, ``Context.publish``: ``**options:
    Unpack[PublishOptions]``), so that they are listed once; ``EventBus.publish`` spells them
    out, and a unit test checks that the two agree.

    :param resource_id: the event's resource: its shard, and its place in per-resource order
    :param headers: str -> str headers carried with the event (default: none)
    """

    resource_id: str
    headers: NotRequired[dict[str, str] | None]


class Publisher:
    """Encodes events and appends them to their shard streams. Created by `EventBus`."""

    def __init__(
        self,
        redis: AsyncRedis,
        settings: Settings,
        keys: Keys,
        registry: TopicRegistry,
        profile: WireProfile = EVENTBUS,
    ) -> None:
        """`keys` names the shard streams (the profile's key layout, `WireProfile.keys`);
        `profile` gives the shard hash and the entry format, both picked here, once."""
        self._redis = redis
        self._settings = settings
        self._keys = keys
        self._registry = registry
        self._shard_of = profile.shard_of
        # None: eventbus's own format, encoded inline by `prepare_envelope`
        self._encode: Callable[[TopicConfig, Envelope], dict[bytes, bytes]] | None = None
        if not profile.codec.native:
            self._encode = partial(_encode_foreign, profile.codec, settings)
        self._streams: dict[str, list[str]] = {}
        self._types_ok: set[str] = set()  # event type names `_check_type` passed
        self.sender = Sender(redis, settings)
        self.dictionaries = Dictionaries(redis, keys)  # the topics' current zstd dictionaries
        self._setup = TopicSetup(registry, self.dictionaries, settings, self.sender.backoff)

    def _streams_of(self, topic: TopicConfig) -> list[str]:
        """The shard stream keys of `topic`, by shard (made once per topic)."""
        streams = self._streams[topic.name] = [
            self._keys.stream(topic.name, s) for s in range(topic.shards)
        ]
        return streams

    def _stream(self, topic: TopicConfig, resource_id: str) -> str:
        """The shard stream key of `resource_id` in `topic` (`prepare_envelope` has it inline)."""
        streams = self._streams.get(topic.name) or self._streams_of(topic)
        return streams[self._shard_of(resource_id, topic.shards)]

    def prepare(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> tuple[str, dict[bytes, bytes]]:
        """Encode `event` for `topic`: returns (shard stream key, entry fields).

        Raises `ConfigError` for an empty resource ID or a non-model event, and `PayloadTooLarge`
        when the entry is over `max_payload_bytes`.
        """
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        return self.prepare_envelope(topic, envelope_of(resource_id, event, headers))

    def prepare_envelope(
        self, topic: TopicConfig, envelope: Envelope
    ) -> tuple[str, dict[bytes, bytes]]:
        """Encode a ready envelope (e.g. a raw payload from the CLI); see `prepare`.

        Refuses what every consumer would refuse: raises `ReservedEventType`, `InvalidEvent`
        (headers not str -> str, text that is not valid UTF-8, a body over the decoders'
        structural budget), `PayloadTooLarge`, `DecompressedTooLarge`.

        One function on eventbus's own format (the common case, once per `publish()`): the
        checks, the encoding and the stream key inline, no call per step.
        """
        rid, etype = envelope.resource_id, envelope.event_type
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"resource_id must be a non-empty string, got {rid!r}")
        if not isinstance(etype, str) or not etype:
            raise InvalidEvent(topic.name, "event type", f"must be a non-empty string: {etype!r}")
        if etype not in self._types_ok:  # checked once per name
            self._check_type(topic, etype)
        if envelope.headers:
            _check_headers(topic, envelope.headers)
        if self._encode is not None:  # another wire format (`WireProfile.codec`)
            fields = self._encode(topic, envelope)
        else:  # first: it says which text is not UTF-8
            settings = self._settings
            try:
                fields = encode_entry(
                    envelope,
                    compress_threshold=settings.compress_threshold_bytes,
                    dictionary=self.dictionaries.cached_current(topic.name),
                )
            except UnicodeEncodeError:  # which text: checked again, one by one, to say it
                _check_text(topic, "resource_id", rid)
                _check_text(topic, "event type", etype)
                raise
            data = fields[F_DATA]
            size = len(data) + len(fields[F_RESOURCE]) + len(fields[F_TYPE]) + _FIELD_NAME_BYTES
            if size > settings.max_payload_bytes:
                raise PayloadTooLarge(topic.name, size, settings.max_payload_bytes)
            if data[0] != FORMAT_MSGPACK or len(data) > MIN_CONTAINERS:  # (else: always decodes)
                self._check_decodable(topic, fields)
        streams = self._streams.get(topic.name) or self._streams_of(topic)
        return streams[self._shard_of(rid, topic.shards)], fields

    def _check_type(self, topic: TopicConfig, etype: str) -> None:
        """Raise `ReservedEventType` or `InvalidEventType` for event type `etype`; remember a
        valid one (up to `_TYPES_KEPT` names: a producer of random names is checked each time)."""
        where = f"publish to topic {topic.name!r}"
        if etype.startswith(RESERVED_TYPE_PREFIX):
            raise ReservedEventType(etype, where)
        check_event_type(etype, where)
        if len(self._types_ok) < _TYPES_KEPT:
            self._types_ok.add(etype)

    def _check_decodable(self, topic: TopicConfig, fields: dict[bytes, bytes]) -> None:
        """Refuse an entry consumers could not decode: over `max_decompressed_bytes` once
        decompressed, or (bodies over `MIN_CONTAINERS` bytes only: smaller ones always fit)
        over the structural budget. The latter decodes the entry once, like a consumer."""
        limit = self._settings.max_decompressed_bytes
        body_size = decompressed_size(fields[F_DATA])
        if body_size > limit:
            raise DecompressedTooLarge(topic.name, body_size, limit)
        if body_size < 0 or body_size > MIN_CONTAINERS:
            try:
                decode_entry(fields, max_bytes=limit)
            except DecodeError as exc:
                raise InvalidEvent(topic.name, "payload", f"would not decode: {exc}") from None

    def publish(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> Awaitable[str]:
        """Append one event; returns its entry ID (``<ms>-<seq>``) once Redis has accepted it.

        Raises `ShardCountMismatch`, `PayloadTooLarge`, `ConfigError` (`ReservedEventType`,
        `InvalidEvent`), or `PublishError` when Redis did not confirm the XADD within
        `publish_timeout_s` seconds of the call (it may still have stored it).
        """
        if hooks.tracing is not None:  # a plain function: no extra coroutine when off
            send = partial(self._publish, topic, event, resource_id)
            return hooks.tracing.publish(send, topic.name, headers, 1)
        return self._publish(topic, event, resource_id, headers)

    async def _publish(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> str:
        # Before the first await: the call's place in the order, and its deadline (enforced by
        # the sender: a cancel scope per call cost ~10x the rest of publish() under load).
        slot = self.sender.reserve(self._settings.publish_timeout_s)
        try:
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
            if not isinstance(event, BaseModel):  # (`prepare`, inline: once per call)
                raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
            envelope = envelope_of(resource_id, event, headers)
            stream, fields = self.prepare_envelope(topic, envelope)
        except BaseException:
            self.sender.withdraw(slot)
            raise
        self.sender.ready(slot, stream, fields, topic.maxlen)
        if slot.queued and self.sender.running:  # `Sender.sends`, inline: the flusher sends it
            return await slot.future
        return await self.sender.submit(slot)

    async def publish_envelope(self, topic: TopicConfig, envelope: Envelope) -> str:
        """Append a ready envelope (no model needed); returns its entry ID. Same errors and
        deadline as `publish`."""
        slot = self.sender.reserve(self._settings.publish_timeout_s)
        try:
            # rarely, as in `_publish`: run per call, its cancel scope cost more than the rest
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
            stream, fields = self.prepare_envelope(topic, envelope)
        except BaseException:
            self.sender.withdraw(slot)
            raise
        self.sender.ready(slot, stream, fields, topic.maxlen)
        return await self.sender.submit(slot)

    def publish_many(
        self,
        topic: TopicConfig,
        events: Iterable[tuple[str, BaseModel]],
        headers: dict[str, str] | None = None,
    ) -> Awaitable[list[str]]:
        """Append `(resource_id, event)` pairs in order, in pipelines of `publish_batch_max`,
        in call order with concurrent `publish()` calls.

        Returns the entry IDs in input order. Every event is encoded (and size-checked) before the
        first is sent, so a bad event fails the call with nothing published. A `PublishError` of
        one pipeline is raised after the others were sent: the events of the pipelines that
        succeeded stay published (their IDs are in the error's ``entry_ids``, None where failed).
        """
        pairs = list(events)
        if hooks.tracing is not None:
            send = partial(self._publish_many, topic, pairs)
            return hooks.tracing.publish(send, topic.name, headers, len(pairs))
        return self._publish_many(topic, pairs, headers)

    def _publish_many(
        self,
        topic: TopicConfig,
        pairs: list[tuple[str, BaseModel]],
        headers: dict[str, str] | None,
    ) -> Awaitable[list[str]]:
        return self._send_many(
            topic, lambda: [self.prepare(topic, ev, rid, headers) for rid, ev in pairs]
        )

    def publish_envelopes(
        self, topic: TopicConfig, envelopes: list[Envelope]
    ) -> Awaitable[list[str]]:
        """Append ready envelopes (no model needed) as `publish_many` appends events: in list
        order, in pipelines of `publish_batch_max`, every envelope encoded and checked before
        the first is sent (a bad one raises `publish_envelope`'s errors with nothing of the call
        published). Returns the entry IDs in list order; raises `PublishError` with
        ``entry_ids`` as `publish_many` does. Used by the Spark writer, one call per chunk of
        rows."""
        return self._send_many(topic, lambda: [self.prepare_envelope(topic, e) for e in envelopes])

    async def _send_many(
        self, topic: TopicConfig, prepare: Callable[[], list[tuple[str, dict[bytes, bytes]]]]
    ) -> list[str]:
        """`publish_many`'s body: `prepare()` encodes every entry (again if the topic's
        dictionary changed during the topic's setup)."""
        used = self.dictionaries.cached_current(topic.name)
        prepared = prepare()
        slots = self.sender.reserve_many(len(prepared))  # no await before: call order
        try:
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
                if self.dictionaries.cached_current(topic.name) != used:  # the new dictionary
                    prepared = prepare()
            for slot, (stream, fields) in zip(slots, prepared, strict=True):
                self.sender.ready(slot, stream, fields, topic.maxlen)
            if slots and not self.sender.sends(slots[0]):  # (all reserved at once)
                await self.sender.send_now(slots)
            # Each future in turn, not `asyncio.wait` (a done-callback, so a `call_soon`, per
            # future): one wake-up per pipeline of replies, the settled ones return at once.
            for slot in slots:
                if not slot.future.done():
                    await asyncio.wait((slot.future,))
        finally:
            for slot in slots:
                self.sender.withdraw(slot)
        errors = [s.future.exception() for s in slots]
        if any(errors):
            first = next(e for e in errors if e is not None)
            exc = PublishError(f"{sum(map(bool, errors))} of {len(slots)} events failed: {first}")
            exc.entry_ids = [
                None if e else s.future.result() for s, e in zip(slots, errors, strict=True)
            ]
            raise exc
        return [s.future.result() for s in slots]

    async def run_flusher(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Send queued publishes in call order until cancelled (run by the bus); see
        `eventbus.publishing.sending`."""
        await self.sender.run(task_status=task_status)


def _check_text(topic: TopicConfig, what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(
            topic.name, what, f"{text!r} is not valid UTF-8 text ({exc.reason})"
        ) from None


def _check_headers(topic: TopicConfig, headers: Any) -> None:
    if not isinstance(headers, dict):
        raise InvalidEvent(topic.name, "headers", f"must be a dict of str -> str, not {headers!r}")
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidEvent(
                topic.name,
                "headers",
                f"must map str to str: {key!r}: {value!r} (convert it with str())",
            )
        _check_text(topic, f"header {key!r}", key + value)
