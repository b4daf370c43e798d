"""The error hierarchy: every error eventbus raises is an `EventBusError`.

Each error names the key, topic or object it concerns, so that a log line is enough to act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eventbus.config import Settings


class EventBusError(Exception):
    """Base class of every error raised by eventbus.

    Every one pickles (a process pool or a task queue sends it back to its caller): it is
    rebuilt from its message and attributes, not by calling its ``__init__`` again, whose
    arguments differ from class to class.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpickle, (type(self), self.args), self.__dict__


def cut(text: str, limit: int = 300) -> str:
    """`text` cut to at most `limit` characters, for an error message."""
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def shown(value: object, limit: int = 80) -> str:
    """`value`'s repr for an error message, cut to `limit` characters (the repr of a module's
    attribute or a mapping can run to thousands)."""
    return cut(repr(value), limit)


def extra_missing(module: str, extra: str, exc: ImportError) -> ModuleNotFoundError:
    """The error of importing `module` (``eventbus.fastapi``) without its optional
    dependencies: a `ModuleNotFoundError` (``except ImportError`` still catches it) naming the
    missing package and the extra to install, ``pip install 'eventbus[<extra>]'``."""
    missing = exc.name or str(exc)
    error = ModuleNotFoundError(
        f"{module} needs the {extra!r} extra ({missing} is not installed): "
        f"pip install 'eventbus[{extra}]'",
        name=exc.name,
    )
    return error


class ConfigError(EventBusError):
    """A setting or argument is invalid (bad topic name, shard count out of range, ...)."""


class ShardCountMismatch(EventBusError):
    """A topic's stored shard count differs from the configured one.

    Publishing or consuming with another count would send a resource's events to different shard
    streams and silently break per-resource ordering, so both sides refuse to start instead.
    """

    def __init__(self, topic: str, stored: int, configured: int) -> None:
        super().__init__(
            f"topic {topic!r} has {stored} shards in Redis but {configured} are configured; "
            f"set shards={stored} (the shard count of a topic cannot change in place)"
        )
        self.topic, self.stored, self.configured = topic, stored, configured


class PayloadTooLarge(EventBusError):
    """An encoded event is larger than `max_payload_bytes`; it was not published. `size` and
    `limit` are in bytes."""

    _too_large = (
        "encodes to {size} bytes, over the limit of {limit} bytes (EVENTBUS_MAX_PAYLOAD_BYTES)"
    )

    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(
            f"event for topic {topic!r} {self._too_large.format(size=size, limit=limit)}"
        )
        self.topic, self.size, self.limit = topic, size, limit


class DecodeError(EventBusError):
    """A stream entry cannot be decoded into an event (bad bytes, missing field, wrong schema)."""


def undecodable(exc: Exception) -> DecodeError:
    """`exc`, raised while decoding an entry, as the `DecodeError` the entry is dead-lettered
    (or dropped, or reported) with: itself when it is one, else a `DecodeError` naming its class
    (a ``RecursionError`` of a deeply nested value, a ``MemoryError``, a bug of a decoder), with
    `exc` as its cause. Whatever bytes another client wrote must stop that entry, not the
    consumer (docs/security.md, "Fuzzing the decoders")."""
    if isinstance(exc, DecodeError):
        return exc
    error = DecodeError(f"{type(exc).__name__} while decoding: {cut(str(exc), 200)}")
    error.__cause__ = exc
    return error


class UnknownEventType(DecodeError):
    """An entry's event type is not one the subscriber's handlers accept (`event_type`)."""

    def __init__(self, message: str, *, event_type: str = "") -> None:
        super().__init__(message)
        self.event_type = event_type


class PublishError(EventBusError):
    """Redis did not confirm an XADD: the event may or may not be stored (see its event ID).

    From `publish_many`, `entry_ids` lists the IDs of the events that were stored (None for
    the others), in input order.
    """

    entry_ids: list[str | None] | None = None


class RedisUnavailable(EventBusError):
    """Redis could not be reached, refused the credentials, or did not answer in time (wrong
    URL, server down, network, a server that accepts and never answers). The message names the
    URL with its password redacted, or, with Sentinel, the sentinels and the service (the URL's
    host and port are not used then)."""

    @classmethod
    def of(cls, settings: Settings, exc: BaseException) -> RedisUnavailable:
        """The error for `exc`, met talking to the Redis of `settings`."""
        from eventbus.config.addresses import scrub

        url = settings.redacted_url
        if settings.sentinels:
            url = f"service {settings.sentinel_service!r} of sentinels {settings.sentinels}"
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
            what = (
                f"Redis at {url} did not answer within {settings.redis_read_timeout_s:g} s "
                f"(connect {settings.redis_connect_timeout_s:g} s); check that the URL names a "
                "Redis server and that it is not stopped"
            )
        else:
            reason = scrub(f"{type(exc).__name__}: {exc}", settings.redis_url)
            what = f"cannot reach Redis at {url}: {reason}; check the URL, password and server"
            if settings.cluster and "Cluster mode is not enabled" in reason:  # redis-py's words
                what += (
                    ", and that the user may run CLUSTER SLOTS and COMMAND (ACL +cluster|slots "
                    "+command: docs/security.md)"
                )
        return cls(what)


class InvalidName(ConfigError):
    """A topic, group or key-prefix name is not allowed (characters, length, ``.``/``..``, a
    leading ``-``). `kind` says which name, `name` is the value refused."""

    rule = "1-100 characters of [A-Za-z0-9_.-], not '.' or '..', not starting with '-'"

    def __init__(self, kind: str, name: object, reason: str) -> None:
        super().__init__(f"invalid {kind} name {name!r}: {reason}; use {self.rule}")
        self.kind, self.name, self.reason = kind, name, reason


class ReservedEventType(ConfigError):
    """An event type starting with ``__eventbus.`` was published or subscribed to: that
    namespace belongs to eventbus's own control entries, which consumers never hand to
    handlers. `event_type` is the name refused."""

    def __init__(self, event_type: str, where: str) -> None:
        why = "names starting with '__eventbus.' belong to eventbus's control entries"
        super().__init__(f"{where}: event type {event_type!r} is reserved ({why}); rename it")
        self.event_type, self.where = event_type, where


class InvalidEventType(ConfigError):
    """An event type name is not allowed: not 1-200 characters of ``[A-Za-z0-9_.-]`` (a space,
    ``:`` or ``/`` would make keys, AsyncAPI names and tools ambiguous). `event_type` is the
    name refused, `where` what used it."""

    rule = "1-200 characters of [A-Za-z0-9_.-]"
    source = "(the model's __event_type__, or its class name)"

    def __init__(self, event_type: object, where: str) -> None:
        super().__init__(
            f"{where}: invalid event type {event_type!r}: use {self.rule} {self.source}"
        )
        self.event_type, self.where = event_type, where


class InvalidEvent(ConfigError):
    """An event cannot be published because every consumer would refuse it: a header that is
    not a str -> str pair, or a resource ID that cannot be encoded as UTF-8. `field` names the
    part at fault."""

    def __init__(self, topic: str, field: str, reason: str) -> None:
        super().__init__(f"event for topic {topic!r} not published: {field} {reason}")
        self.topic, self.field, self.reason = topic, field, reason


class DecompressedTooLarge(PayloadTooLarge):
    """A compressed entry is small enough to send, but its envelope decompresses to more than
    consumers accept (`Settings.max_decompressed_bytes`); it was not published."""

    _too_large = (
        "decompresses to {size} bytes, over the {limit} bytes consumers accept "
        "(64 x EVENTBUS_MAX_PAYLOAD_BYTES); make the event smaller"
    )


class RedisCommandRefused(EventBusError):
    """Redis answered a command with an error reply (NOPERM under an ACL, OOM, ...). `command`
    and `key` say what was refused, `reply` is the server's message."""

    def __init__(self, command: str, key: str, reply: str) -> None:
        super().__init__(
            f"Redis refused {command} on {key!r}: {reply}; check the user's ACL "
            "(docs/security.md) and the server's state"
        )
        self.command, self.key, self.reply = command, key, reply


class MalformedDeadLetter(EventBusError):
    """A dead-letter entry lacks a field or holds a value of the wrong form (written by
    something other than eventbus). `dlq_id` names the entry; inspect it with XRANGE."""

    def __init__(self, dlq_id: str, reason: str) -> None:
        super().__init__(
            f"dead letter {dlq_id} is malformed ({reason}); inspect it with XRANGE or drop it"
        )
        self.dlq_id, self.reason = dlq_id, reason


class ForgedControlEntry(EventBusError):
    """An entry claims to be an operator's control entry (``__eventbus.*`` type) but carries no
    nonce of a request recorded by ``eventbus dlq`` for its group: dead-lettered as ``forged``,
    never executed. `entry_id` names it."""

    def __init__(self, entry_id: str, reason: str) -> None:
        super().__init__(
            f"control entry {entry_id} is not authenticated ({reason}): not executed; if the "
            "operator did send it, run the eventbus dlq command again"
        )
        self.entry_id, self.reason = entry_id, reason


class HandlerTimeout(EventBusError):
    """A handler attempt ran past its `handler_timeout_s`: it was cancelled (async handler) or
    abandoned (sync handler, whose thread cannot be stopped) and counts as a failed attempt."""

    def __init__(self, handler: str, timeout_s: float, abandoned: bool) -> None:
        what = "abandoned (its thread runs on)" if abandoned else "cancelled"
        super().__init__(
            f"handler {handler} did not finish within {timeout_s:g} s: {what}; make it faster "
            "or raise handler_timeout_s"
        )
        self.handler, self.timeout_s, self.abandoned = handler, timeout_s, abandoned


class RequestTimeout(EventBusError):
    """`EventBus.request` got no reply within its `timeout_s`. `groups` are the consumer groups
    reading the request's shard stream when it gave up (empty: nobody subscribes to `topic`),
    unless they could not be listed: then `groups_unknown` says why (the server's reason, e.g.
    NOPERM for a user without ``XINFO GROUPS``) and `groups` is empty."""

    def __init__(
        self,
        topic: str,
        resource_id: str,
        timeout_s: float,
        entry_id: str | None,
        groups: list[str],
        groups_unknown: str | None = None,
    ) -> None:
        sent = f"request {entry_id}" if entry_id else "the request (not confirmed by Redis)"
        if groups_unknown is not None:
            why = (
                f"the consumer groups of topic {topic!r} could not be listed ({groups_unknown}), "
                "so whether anybody subscribes to it is unknown"
            )
        elif not groups:
            why = f"no consumer group reads topic {topic!r}: nobody subscribes to it"
        else:
            why = (
                f"groups {', '.join(groups)} read topic {topic!r}, but none replied: is a "
                "subscriber running, and does its handler return a pydantic model?"
            )
        super().__init__(
            f"no reply within {timeout_s:g} s to {sent} on topic {topic!r} (resource "
            f"{resource_id!r}): {why}"
        )
        self.topic, self.resource_id, self.timeout_s = topic, resource_id, timeout_s
        self.entry_id, self.groups, self.groups_unknown = entry_id, groups, groups_unknown


class InvalidReply(EventBusError):
    """A handler answering a request (`EventBus.request`) returned something other than a
    pydantic model, or the request named a reply stream that is not one of eventbus's."""


def _unpickle(cls: type[EventBusError], args: tuple[Any, ...]) -> EventBusError:
    """An instance of `cls` with `args`, its ``__init__`` not called (`EventBusError.__reduce__`);
    pickle then restores its attributes."""
    return cls.__new__(cls, *args)
