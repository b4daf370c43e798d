"""Dead letters of a consumer group: list, inspect, requeue, drop; parked resources.

Each (topic, group) has one dead-letter stream (`Keys.dead_letter`). A dead-letter entry holds
the original entry's fields (``orig_rid``, ``orig_type``, ``orig_data``) and why it is there:

==================  =========================================================================
field               meaning
==================  =========================================================================
``topic``/``group`` where it was consumed
``shard``           shard it was read from; ``entry_id``: its entry ID there
``reason``          ``failed`` (handler failed ``attempts`` times), ``undecodable`` (bad bytes,
                    missing field, unknown type, payload failing validation), ``parked`` (its
                    resource was parked: not attempted), ``forged`` (a control entry without
                    a recorded request: not executed)
``error_type``      exception class name; ``error``: its message (first 4 KiB)
``traceback``       the exception's traceback as Python prints it (its last 4 KiB)
``attempts``        handler attempts made (0 when not attempted)
``failed_at_ms``    Unix time (ms) it was dead-lettered
==================  =========================================================================

With ``on_failure="park"`` a resource whose event exhausted its attempts is *parked*: its later
events in that group go to the dead-letter stream too, in order, until an operator requeues or
drops the resource. Both go through the resource's own shard stream as a *control entry*
(event type ``__eventbus.unpark`` or ``__eventbus.drop``, naming the group), so the consumer
that owns the resource handles it in sequence with the resource's events: parked events are
replayed (or discarded) before any event published after the request. Order is never broken.

Control entries are authenticated: the operator first records the request under a random nonce
in the group's control hash (`Keys.control`, which the publisher ACL of docs/security.md cannot
write), and the control entry carries that nonce. A consumer executes a control entry only when
its nonce names a recorded request of the same kind and resource, and deletes the request once
done; anything else of a ``__eventbus.`` type is dead-lettered with reason ``forged``. (So is a
control entry delivered again after it was executed, when its consumer died before the ack.)
"""

from __future__ import annotations

import json
import secrets
import time
import traceback
from dataclasses import dataclass
from typing import Any

from eventbus.errors import EventBusError, MalformedDeadLetter
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    RESERVED_TYPE_PREFIX,
    Envelope,
    encode_entry,
    new_event_id,
)
from eventbus.protocol.keys import Keys
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicConfig

CONTROL_PREFIX = RESERVED_TYPE_PREFIX
UNPARK = "__eventbus.unpark"
TRACEBACK_BYTES = 4096
DROP = "__eventbus.drop"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter entry, decoded. `dlq_id` is its entry ID in the dead-letter stream."""

    dlq_id: str
    shard: int
    entry_id: str
    resource_id: str | None
    event_type: str | None
    reason: str
    error_type: str
    error: str
    attempts: int
    failed_at_ms: int
    fields: dict[bytes, bytes]
    traceback: str = ""
    problems: tuple[str, ...] = ()
    """What is wrong with the entry when it was not written by eventbus (a number field that is
    not one, no original entry); empty for a well-formed dead letter."""

    @classmethod
    def parse(cls, dlq_id: bytes | str, f: dict[bytes, bytes]) -> DeadLetter:
        """Decode a dead-letter entry. Never raises: a field of the wrong form takes a default
        (-1 or 0) and is named in `problems`, so that one bad entry does not hide the others."""
        problems: list[str] = []

        def text(key: bytes) -> str | None:
            v = f.get(key)
            return v.decode("utf-8", "replace") if v is not None else None

        def number(key: bytes, default: int) -> int:
            v = f.get(key)
            if v is None:
                return default
            try:
                return int(v)
            except ValueError:
                problems.append(f"{key.decode()} is not an integer: {v[:40]!r}")
                return default

        if b"orig_" + F_DATA not in f:
            problems.append("no original entry (orig_data)")
        return cls(
            dlq_id=dlq_id.decode() if isinstance(dlq_id, bytes) else dlq_id,
            shard=number(b"shard", -1),
            entry_id=text(b"entry_id") or "",
            resource_id=text(b"orig_" + F_RESOURCE),
            event_type=text(b"orig_" + F_TYPE),
            reason=text(b"reason") or "failed",
            error_type=text(b"error_type") or "",
            error=text(b"error") or "",
            attempts=number(b"attempts", 0),
            failed_at_ms=number(b"failed_at_ms", 0),
            fields=f,
            traceback=text(b"traceback") or "",
            problems=tuple(problems),
        )

    def original(self) -> dict[bytes, bytes]:
        """The original entry's fields, as they were in the shard stream."""
        prefix = b"orig_"
        return {k[len(prefix) :]: v for k, v in self.fields.items() if k.startswith(prefix)}


def traceback_tail(exc: BaseException, limit: int = TRACEBACK_BYTES) -> bytes:
    """The last `limit` bytes of `exc`'s traceback as Python prints it (UTF-8; the innermost
    frames, where it was raised, are at the end)."""
    text = "".join(traceback.format_exception(exc)).encode("utf-8", "replace")
    if len(text) <= limit:
        return text
    return text[-limit:].decode("utf-8", "ignore").encode()


def dead_letter_fields(
    *,
    topic: str,
    group: str,
    shard: int,
    entry_id: bytes | str,
    reason: str,
    exc: BaseException | None,
    attempts: int,
    original: dict[bytes, bytes],
) -> dict[bytes, bytes]:
    """The fields of a dead-letter entry (see the table above); `original` is the entry's own
    field map, kept as ``orig_<name>``. The error message is cut to 4 KiB, the traceback to its
    last 4 KiB (`traceback_tail`)."""
    fields = {
        b"topic": topic.encode(),
        b"group": group.encode(),
        b"shard": str(shard).encode(),
        b"entry_id": entry_id if isinstance(entry_id, bytes) else entry_id.encode(),
        b"reason": reason.encode(),
        b"error_type": type(exc).__name__.encode() if exc else b"",
        b"error": str(exc).encode()[:4096] if exc else b"resource is parked",
        b"traceback": traceback_tail(exc) if exc else b"",
        b"attempts": str(attempts).encode(),
        b"failed_at_ms": str(time.time_ns() // 1_000_000).encode(),
    }
    for name, value in original.items():
        fields[b"orig_" + name] = value
    return fields


def control_entry(
    kind: str, resource_id: str, group: str, *, nonce: str | None = None
) -> dict[bytes, bytes]:
    """Fields of a control entry asking `group`'s consumer to unpark or drop `resource_id`;
    `nonce` names the request recorded in the group's control hash (`control_request`)."""
    payload = {"group": group} if nonce is None else {"group": group, "nonce": nonce}
    env = Envelope(
        resource_id=resource_id,
        event_type=kind,
        event_id_bytes=new_event_id(),
        published_at_ms=time.time_ns() // 1_000_000,
        payload=payload,
    )
    return encode_entry(env, compress_threshold=1 << 30)


def control_request(kind: str, resource_id: str) -> bytes:
    """The value recorded under a control entry's nonce in `Keys.control`: what it may do."""
    return json.dumps({"kind": kind, "resource": resource_id}, sort_keys=True).encode()


class DeadLetters:
    """Operator API over the dead letters of (topic, group). `redis` is a redis-py asyncio
    client; `topic` carries the shard count (use the stored one, see `TopicRegistry.stored`).
    """

    def __init__(self, redis: Any, keys: Keys, topic: TopicConfig, group: str) -> None:
        self.redis = redis
        self.keys = keys
        self.topic = topic
        self.group = group
        self.stream = keys.dead_letter(topic.name, group)

    async def letters(self, count: int = 100, start: str = "-") -> list[DeadLetter]:
        """Up to `count` dead letters from entry ID `start` on, oldest first."""
        rows = await self.redis.xrange(self.stream, min=start, count=count)
        return [DeadLetter.parse(i, f) for i, f in rows]

    async def get(self, dlq_id: str) -> DeadLetter | None:
        rows = await self.redis.xrange(self.stream, min=dlq_id, max=dlq_id)
        return DeadLetter.parse(*rows[0]) if rows else None

    async def parked(self) -> dict[str, str]:
        """Parked resources: resource ID -> dead-letter ID of its first parked event."""
        raw = await self.redis.hgetall(self.keys.parked(self.topic.name, self.group))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def requeue(self, dlq_ids: list[str]) -> list[str]:
        """Append these dead letters' original entries to their shard streams again, then delete
        them from the dead-letter stream. Returns the new entry IDs.

        Raises `EventBusError` (and requeues nothing) if an ID is unknown or belongs to a parked
        resource: use `requeue_resource` for those, so that their order holds;
        `MalformedDeadLetter` if one holds no original entry.
        """
        letters = await self._fetch(dlq_ids)
        parked = await self.parked()
        for d in letters:
            if F_DATA not in d.original():
                raise MalformedDeadLetter(d.dlq_id, "; ".join(d.problems))
            if d.resource_id in parked:
                raise EventBusError(
                    f"{d.dlq_id}: resource {d.resource_id!r} is parked; requeue the resource"
                )
        new_ids = []
        for d in letters:
            rid = d.resource_id
            shard = shard_of(rid, self.topic.shards) if rid else max(d.shard, 0)
            new_ids.append(
                (
                    await self.redis.xadd(
                        self.keys.stream(self.topic.name, shard),
                        d.original(),
                        maxlen=self.topic.maxlen,
                        approximate=True,
                    )
                ).decode()
            )
            await self.redis.xdel(self.stream, d.dlq_id)
        return new_ids

    async def drop(self, dlq_ids: list[str]) -> int:
        """Delete dead letters for good; returns how many existed. Parked resources' letters are
        refused (use `drop_resource`)."""
        letters = await self._fetch(dlq_ids)
        parked = await self.parked()
        if any(d.resource_id in parked for d in letters):
            raise EventBusError("some letters belong to a parked resource: drop the resource")
        return int(await self.redis.xdel(self.stream, *dlq_ids)) if dlq_ids else 0

    async def requeue_resource(self, resource_id: str) -> str:
        """Ask the group's consumer to replay `resource_id`'s parked events, in order, and then
        unpark it. Returns the control entry's ID. Raises `EventBusError` if it is not parked."""
        return await self._control(UNPARK, resource_id)

    async def drop_resource(self, resource_id: str) -> str:
        """Ask the group's consumer to delete `resource_id`'s parked events and unpark it."""
        return await self._control(DROP, resource_id)

    async def _control(self, kind: str, resource_id: str) -> str:
        # The operator's own path: written with XADD here, not through `Publisher`, which
        # refuses every reserved (``__eventbus.``) type from applications. The request is
        # recorded first, under a fresh nonce, so that the consumer can tell it from a forgery.
        if resource_id not in await self.parked():
            raise EventBusError(f"resource {resource_id!r} is not parked in group {self.group!r}")
        nonce = secrets.token_hex(16)
        await self.redis.hsetnx(
            self.keys.control(self.topic.name, self.group),
            nonce,
            control_request(kind, resource_id),
        )
        stream = self.keys.stream(self.topic.name, shard_of(resource_id, self.topic.shards))
        fields = control_entry(kind, resource_id, self.group, nonce=nonce)
        entry_id = await self.redis.xadd(stream, fields)
        return str(entry_id.decode())

    async def _fetch(self, dlq_ids: list[str]) -> list[DeadLetter]:
        letters = []
        for i in dlq_ids:
            d = await self.get(i)
            if d is None:
                raise EventBusError(f"no dead letter {i} in {self.stream}")
            letters.append(d)
        return letters


_CONTROL_PREFIX_BYTES = CONTROL_PREFIX.encode()


def is_control(fields: dict[bytes, bytes]) -> bool:
    """Whether a stream entry is a control entry (never given to handlers)."""
    return fields.get(F_TYPE, b"").startswith(_CONTROL_PREFIX_BYTES)


__all__ = [
    "DROP",
    "UNPARK",
    "DeadLetter",
    "DeadLetters",
    "control_entry",
    "control_request",
    "dead_letter_fields",
    "is_control",
]
