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
database committed. A sync session publishes through ``bus.sync()``: from a worker thread (a
FastAPI ``def`` route) on the loop the bus runs on (`eventbus.fastapi.lifespan`).

An ``AsyncSession`` commits on the event loop, where the commit hook cannot wait: its commit
*starts* the publish on that loop, and ``await after_commit.flush(session)`` waits for it
(entry IDs, or the `PublishError`; a failure is also logged at ERROR, flushed or not)::

    async with session.begin():
        session.add(order)
        after_commit.publish(session, "orders", OrderPlaced(...), resource_id=order.id)
    await after_commit.flush(session)

`AfterCommit.publish` refuses, before anything is committed, what could not be published after
it: an event `EventBus.publish` would refuse (checked without Redis), a session `listen` does not
cover, and a sync session on the event loop the bus runs on (its commit would block the loop that
must publish).

The trade-off (docs/semantics.md, "Publish after commit"): this is not a transactional outbox.
If the process dies, or Redis stays unreachable past ``publish_timeout_s``, between the commit and
the publish, the committed change has no event, and nothing retries it. What is guaranteed: no
event for a change that was rolled back, and no event before its change is visible. Where every
event must survive a crash, write the events to an outbox table in the same transaction and have
a relay publish and delete them (at-least-once, with the event ID for de-duplication).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

from pydantic import BaseModel
from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, SessionTransaction

from eventbus.app import EventBus
from eventbus.errors import ConfigError
from eventbus.session import current_loop

log = logging.getLogger("eventbus")

_PENDING = "eventbus.outbox.pending"
_MARKS = "eventbus.outbox.savepoints"
_ASYNC = "eventbus.outbox.async"  # an AsyncSession's: its commit starts the publish
_STARTED = "eventbus.outbox.started"  # those publishes, for `flush`


class Pending(NamedTuple):
    """One event waiting for its transaction to commit: the arguments of its publish."""

    topic: str
    event: BaseModel
    resource_id: str
    headers: dict[str, str] | None


class AfterCommit:
    """Queues events per session and publishes them through `bus` after commit."""

    def __init__(self, bus: EventBus) -> None:
        """:param bus: the bus to publish on: through its blocking facade (``bus.sync()``) for a
        sync session, SQLAlchemy's session events being synchronous; on the session's event
        loop for an ``AsyncSession``."""
        self.bus = bus

    def listen(self, target: Any) -> None:
        """Hook the session events of `target`: a `Session` subclass, a ``sessionmaker``, one
        session (``sqlalchemy.event.listen`` targets), an ``AsyncSession`` or an
        ``async_sessionmaker`` (its ``sync_session_class``: give it a subclass of your own,
        or every `Session` of the process is hooked). Call it once per target."""
        maker_kw = getattr(target, "kw", None)
        if isinstance(maker_kw, dict) and type(target).__name__ == "async_sessionmaker":
            target = maker_kw.get("sync_session_class") or Session
        elif isinstance(getattr(target, "sync_session", None), Session):
            target = target.sync_session
        sa_event.listen(target, "after_transaction_create", _savepoint_began)
        sa_event.listen(target, "after_soft_rollback", _rolled_back)
        sa_event.listen(target, "after_commit", self._committed)

    def publish(
        self,
        session: Any,
        topic: str,
        event: BaseModel,
        *,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Queue `event` for `topic` until `session`'s transaction commits (`EventBus.publish`
        then). `session` is a `Session` or an ``AsyncSession`` (then ``await flush(session)``
        after the commit).

        Raises at once, not at commit time: `ConfigError` when `session` is not hooked by
        `listen`, when it is a sync session on the event loop the bus runs on, or an
        ``AsyncSession`` on another loop than the bus's; and what `EventBus.publish` raises
        for the event without asking Redis: `ConfigError` (topic name, not a pydantic model,
        empty resource ID), `ReservedEventType`, `InvalidEvent` (headers, text),
        `PayloadTooLarge`, `DecompressedTooLarge`.
        """
        sync, is_async = _sync_session(session)
        if self._committed not in sync.dispatch.after_commit:
            raise ConfigError(
                "this session's commits are not hooked: call AfterCommit.listen() with its "
                "sessionmaker, Session class or the session first (else its events are lost)"
            )
        home, here = self.bus.running_loop(), current_loop()
        if is_async and home is not None and here is not home:
            raise ConfigError(
                "this AsyncSession runs on another event loop than the bus: publish from the "
                "loop the bus is entered on"
            )
        if not is_async and home is not None and here is home:
            raise ConfigError(
                "a sync Session committed on the event loop the bus runs on would block the loop "
                "that must publish: use an AsyncSession (then await AfterCommit.flush), or run "
                "the transaction in a worker thread (a plain `def` route)"
            )
        self.bus.publisher.prepare(self.bus.topic(topic), event, resource_id, headers)
        sync.info.setdefault(_PENDING, []).append(Pending(topic, event, resource_id, headers))
        if is_async:
            sync.info[_ASYNC] = True

    def pending(self, session: Any) -> list[Pending]:
        """The events `session` has queued and not yet published (a copy)."""
        return list(_sync_session(session)[0].info.get(_PENDING, ()))

    async def flush(self, session: Any) -> list[str]:
        """Wait for the publishes the commits of an ``AsyncSession`` started; returns their
        entry IDs in call order. Raises the first failure (`PublishError`; the database has
        committed). Cancelling the wait does not cancel the publishes."""
        sync, _ = _sync_session(session)
        started: list[asyncio.Task[list[str]]] = sync.info.pop(_STARTED, [])
        if started:
            await asyncio.wait(started)
        return [entry_id for task in started for entry_id in task.result()]

    def _committed(self, session: Session) -> None:
        items: list[Pending] = session.info.pop(_PENDING, [])
        session.info.pop(_MARKS, None)
        if not items:
            return
        if not session.info.get(_ASYNC):
            self.bus.sync().call(lambda: _publish_all(self.bus, items))
            return
        # an AsyncSession's commit runs on the event loop: it cannot wait here (`flush` does)
        task = asyncio.get_running_loop().create_task(_publish_all(self.bus, items))
        task.add_done_callback(_log_failure)
        started = session.info.setdefault(_STARTED, [])
        started[:] = [t for t in started if not t.done() or _failed(t)]  # flush raises them
        started.append(task)


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


def _failed(task: asyncio.Task[list[str]]) -> bool:
    return not task.cancelled() and task.exception() is not None


def _log_failure(task: asyncio.Task[list[str]]) -> None:
    if _failed(task):
        log.error(
            "publishing events after a commit failed (the database committed): %s",
            task.exception(),
        )


def _sync_session(session: Any) -> tuple[Session, bool]:
    """The `Session` behind `session`, and whether an ``AsyncSession`` drives it."""
    sync = getattr(session, "sync_session", None)
    if isinstance(sync, Session):
        return sync, True
    if not isinstance(session, Session):
        raise ConfigError(
            f"session must be a SQLAlchemy Session or AsyncSession, got {type(session).__name__}"
        )
    try:
        from sqlalchemy.ext.asyncio import async_session
    except ImportError:  # pragma: no cover - SQLAlchemy without its asyncio extension
        return session, False
    return session, async_session(session) is not None


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
