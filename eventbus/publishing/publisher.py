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

What every consumer would refuse is refused before anything is sent, by the publisher's
`Encoder` (`eventbus.publishing.encoding`), which also picks the shard stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import NotRequired, TypedDict

import anyio
from pydantic import BaseModel

from eventbus.config import Settings
from eventbus.errors import ConfigError, PublishError
from eventbus.locking.member import AsyncRedis
from eventbus.ops import hooks
from eventbus.profiles import EVENTBUS, WireProfile
from eventbus.protocol.codec import Envelope, envelope_of
from eventbus.protocol.dictionaries import Dictionaries
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig, TopicRegistry
from eventbus.publishing.encoding import Encoder
from eventbus.publishing.sending import Sender
from eventbus.publishing.topic_setup import TopicSetup

log = logging.getLogger("eventbus.publisher")


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
    """Encodes events (its `encoder`) and appends them to their shard streams in call order
    (its `sender`). Created by `EventBus`."""

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
        self._settings = settings
        self._registry = registry
        self.sender = Sender(redis, settings)
        self._queue = self.sender.queue  # its calls' slots, in call order
        self.dictionaries = Dictionaries(redis, keys)  # the topics' current zstd dictionaries
        self.encoder = Encoder(settings, keys, self.dictionaries, profile)
        self._setup = TopicSetup(registry, self.dictionaries, settings, self.sender.backoff)

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
        slot = self._queue.reserve(self._settings.publish_timeout_s)
        try:
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
            if not isinstance(event, BaseModel):  # (`Encoder.prepare`, inline: once per call)
                raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
            envelope = envelope_of(resource_id, event, headers)
            stream, fields = self.encoder.prepare_envelope(topic, envelope)
        except BaseException:
            self._queue.withdraw(slot)
            raise
        self._queue.ready(slot, stream, fields, topic.maxlen)
        if slot.queued and self._queue.running:  # `Sender.sends`, inline: the flusher sends it
            return await slot.future
        return await self.sender.submit(slot)

    async def publish_envelope(self, topic: TopicConfig, envelope: Envelope) -> str:
        """Append a ready envelope (no model needed); returns its entry ID. Same errors and
        deadline as `publish`."""
        slot = self._queue.reserve(self._settings.publish_timeout_s)
        try:
            # rarely, as in `_publish`: run per call, its cancel scope cost more than the rest
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
            stream, fields = self.encoder.prepare_envelope(topic, envelope)
        except BaseException:
            self._queue.withdraw(slot)
            raise
        self._queue.ready(slot, stream, fields, topic.maxlen)
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
        encode = self.encoder.prepare
        return self._send_many(
            topic, lambda: [encode(topic, ev, rid, headers) for rid, ev in pairs]
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
        encode = self.encoder.prepare_envelope
        return self._send_many(topic, lambda: [encode(topic, e) for e in envelopes])

    async def _send_many(
        self, topic: TopicConfig, prepare: Callable[[], list[tuple[str, dict[bytes, bytes]]]]
    ) -> list[str]:
        """`publish_many`'s body: `prepare()` encodes every entry (again if the topic's
        dictionary changed during the topic's setup)."""
        used = self.dictionaries.cached_current(topic.name)
        prepared = prepare()
        slots = self._queue.reserve_many(len(prepared))  # no await before: call order
        try:
            if not self._registry.checked(topic.name) or self.dictionaries.due(topic.name):
                await self._setup.run(topic)
                if self.dictionaries.cached_current(topic.name) != used:  # the new dictionary
                    prepared = prepare()
            for slot, (stream, fields) in zip(slots, prepared, strict=True):
                self._queue.ready(slot, stream, fields, topic.maxlen)
            if slots and not self.sender.sends(slots[0]):  # (all reserved at once)
                await self.sender.send_now(slots)
            # Each future in turn, not `asyncio.wait` (a done-callback, so a `call_soon`, per
            # future): one wake-up per pipeline of replies, the settled ones return at once.
            for slot in slots:
                if not slot.future.done():
                    await asyncio.wait((slot.future,))
        finally:
            for slot in slots:
                self._queue.withdraw(slot)
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
