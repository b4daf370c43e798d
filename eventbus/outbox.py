"""Publish after commit: events queued during a SQLAlchemy transaction are published only once it
commits, so that a rolled-back transaction publishes nothing::

    from eventbus.outbox import AfterCommit

    after_commit = AfterCommit(bus)
    after_commit.listen(Session)             # a Session class, a sessionmaker or one session

    with Session(engine) as session, session.begin():
        session.add(order)
        after_commit.publish(session, "orders", OrderPlaced(...), resource_id=order.id)
    # committed: the event is published now, before ``session.begin()``'s block returns

It uses SQLAlchemy's session events: ``after_commit`` publishes what the transaction queued (in
call order: concurrent publishes keep their call order, `eventbus.publishing.sending`);
``after_soft_rollback`` drops it (for a savepoint, ``session.begin_nested()``, only what was queued
since the savepoint began). A failed publish raises `PublishError` from ``commit()``, *after* the
database committed.

The trade-off (docs/semantics.md, "Publish after commit"): this is not a transactional outbox.
If the process dies, or Redis stays unreachable past ``publish_timeout_s``, between the commit and
the publish, the committed change has no event, and nothing retries it. What is guaranteed: no
event for a change that was rolled back, and no event before its change is visible. Where every
event must survive a crash, write the events to an outbox table in the same transaction and have
a relay publish and delete them (at-least-once, with the event ID for de-duplication).
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from pydantic import BaseModel
from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, SessionTransaction

from eventbus.app import EventBus
from eventbus.errors import ConfigError

_PENDING = "eventbus.outbox.pending"
_MARKS = "eventbus.outbox.savepoints"


class Pending(NamedTuple):
    """One event waiting for its transaction to commit: the arguments of its publish."""

    topic: str
    event: BaseModel
    resource_id: str
    headers: dict[str, str] | None


class AfterCommit:
    """Queues events per session and publishes them through `bus` after commit."""

    def __init__(self, bus: EventBus) -> None:
        """:param bus: the bus to publish on, through its blocking facade (``bus.sync()``):
        SQLAlchemy's session events are synchronous."""
        self.bus = bus

    def listen(self, target: Any) -> None:
        """Hook the session events of `target`: a `Session` subclass, a ``sessionmaker``, or one
        session (``sqlalchemy.event.listen`` targets). Call it once per target."""
        sa_event.listen(target, "after_transaction_create", _savepoint_began)
        sa_event.listen(target, "after_soft_rollback", _rolled_back)
        sa_event.listen(target, "after_commit", self._committed)

    def publish(
        self,
        session: Session,
        topic: str,
        event: BaseModel,
        *,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Queue `event` for `topic` until `session`'s transaction commits (`EventBus.publish`
        then). Raises `ConfigError` for an event that is not a pydantic model or an empty
        resource ID (at once: not at commit time)."""
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        if not isinstance(resource_id, str) or not resource_id:
            raise ConfigError(f"resource_id must be a non-empty string, got {resource_id!r}")
        session.info.setdefault(_PENDING, []).append(Pending(topic, event, resource_id, headers))

    def pending(self, session: Session) -> list[Pending]:
        """The events `session` has queued and not yet published (a copy)."""
        return list(session.info.get(_PENDING, ()))

    def _committed(self, session: Session) -> None:
        items: list[Pending] = session.info.pop(_PENDING, [])
        session.info.pop(_MARKS, None)
        if items:
            self.bus.sync().call(lambda: _publish_all(self.bus, items))


async def _publish_all(bus: EventBus, items: list[Pending]) -> list[str]:
    """Publish `items` concurrently, in call order (each takes its place in the sender's queue
    when started, and tasks start in order); raises the first failure."""
    return list(
        await asyncio.gather(
            *(
                bus.publish(topic, event, resource_id=resource_id, headers=headers)
                for topic, event, resource_id, headers in items
            )
        )
    )


def _savepoint_began(session: Session, transaction: SessionTransaction) -> None:
    if transaction.nested:
        session.info.setdefault(_MARKS, {})[transaction] = len(session.info.get(_PENDING, ()))


def _rolled_back(session: Session, previous_transaction: SessionTransaction) -> None:
    marks: dict[SessionTransaction, int] = session.info.get(_MARKS, {})
    if previous_transaction.nested and previous_transaction in marks:
        del session.info.get(_PENDING, [])[marks.pop(previous_transaction) :]
    elif not previous_transaction.nested:
        session.info.pop(_PENDING, None)
        session.info.pop(_MARKS, None)
