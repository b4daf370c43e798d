"""Dead letters of a consumer group, for operators: list, inspect, requeue, drop; parked
resources (`DeadLetters`; the ``eventbus dlq`` commands run on it).

Each (topic, group) has one dead-letter stream (`Keys.dead_letter`): its records and the control
entries below are specified in `eventbus.protocol.dead_letters` (`DeadLetter` is one record).

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

import secrets
from typing import Any

from eventbus.errors import EventBusError, MalformedDeadLetter
from eventbus.protocol.codec import F_DATA
from eventbus.protocol.dead_letters import (
    DROP,
    UNPARK,
    DeadLetter,
    control_entry,
    control_request,
    dead_letter_fields,
    is_control,
    parked_resources,
)
from eventbus.protocol.keys import Keys
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicConfig


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
        """Parked resources: resource ID -> dead-letter ID of its first parked event (a field
        that is not UTF-8 is left out with a warning: `parked_resources`)."""
        key = self.keys.parked(self.topic.name, self.group)
        return parked_resources(await self.redis.hgetall(key), key)

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
