"""Publish after commit: events queued during a SQLAlchemy transaction are published only once it
commits, so that a rolled-back transaction publishes nothing::

    from eventbus.outbox import AfterCommit

    after_commit = AfterCommit(bus)
    after_commit.listen(Session)             # a Session class, a sessionmaker or one session

    with Session(engine) as session, session.begin():
        session.add(order)
        after_commit.publish(session, "orders", OrderPlaced(...), resource_id=order.id)
    # committed: the event is published now, before ``session.begin()``'s block returns

It uses SQLAlchemy's session events. ``after_commit`` of the outermost transaction marks what it
queued as committed (a released savepoint, ``session.begin_nested()``, also emits it: its events
wait for the outermost commit); ``after_transaction_end`` of the outermost transaction publishes
them (in call order: concurrent publishes keep their call order, `eventbus.publishing.sending`)
and drops whatever it did not commit, also when ``Session.close()`` or ``reset()`` discards it.
``after_soft_rollback`` drops what a rolled-back savepoint queued; a failed flush rolls back to
the innermost savepoint around it (or the whole transaction), and drops what that one queued.
A failed publish raises `PublishError` from ``commit()``, *after* the database committed; it is
raised once SQLAlchemy has closed the transaction, so the session stays usable (an exception out
of ``after_commit`` would leave it in 'committed' state; listeners of ``after_transaction_end``
hooked after this one do not run for that commit). A sync session publishes through
``bus.sync()``: from a worker thread (a FastAPI ``def`` route) on the loop the bus runs on
(`eventbus.fastapi.lifespan`).

Each event is encoded by `AfterCommit.publish` (event ID and time of the call): changing the
model or the headers dict afterwards does not change what is published. Several `AfterCommit`
objects may hook one session, each with its bus: each publishes what was queued through it.

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
from collections.abc import Awaitable
from typing import Any, NamedTuple

import msgspec
from pydantic import BaseModel

from eventbus.app import EventBus
from eventbus.errors import ConfigError, extra_missing
from eventbus.ops import hooks
from eventbus.protocol.codec import Envelope, envelope_of
from eventbus.session import current_loop

try:
    from sqlalchemy import event as sa_event
    from sqlalchemy.orm import Session, SessionTransaction
except ImportError as exc:
    raise extra_missing("eventbus.outbox", "outbox", exc) from exc

log = logging.getLogger("eventbus")


class Pending(NamedTuple):
    """One event waiting for its transaction to commit: its `topic` and its `envelope`, encoded
    when `AfterCommit.publish` was called (the resource ID, event ID, time, headers and payload
    of that moment: what is published)."""

    topic: str
    envelope: Envelope


class _Queue:
    """One `AfterCommit`'s state in one session (``session.info``, under that one's own key)."""

    __slots__ = ("committed", "is_async", "marks", "pending", "started")

    def __init__(self) -> None:
        self.pending: list[Pending] = []  # queued in the open transaction
        self.marks: dict[SessionTransaction, int] = {}  # savepoint -> len(pending) at its begin
        self.committed: list[Pending] = []  # the outermost transaction committed them
        self.is_async = False  # an AsyncSession's: its commit starts the publish
        self.started: list[asyncio.Task[list[str]]] = []  # those publishes, for `flush`


class AfterCommit:
    """Queues events per session and publishes them through `bus` after commit. Several may
    hook one session (each its own bus): each publishes what was queued through it."""

    def __init__(self, bus: EventBus) -> None:
        """:param bus: the bus to publish on: through its blocking facade (``bus.sync()``) for a
        sync session, SQLAlchemy's session events being synchronous; on the session's event
        loop for an ``AsyncSession``."""
        self.bus = bus
        self._key = f"eventbus.outbox.{id(self):x}"  # its `_Queue` in session.info

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
        sa_event.listen(target, "after_transaction_create", self._began)
        sa_event.listen(target, "after_soft_rollback", self._rolled_back)
        sa_event.listen(target, "after_commit", self._committed)
        sa_event.listen(target, "after_transaction_end", self._ended)

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
        after the commit). The event is encoded now: changing `event` or `headers` after the
        call does not change what is published; its event ID and time are those of the call.
        Queued outside a transaction, it belongs to the session's next one.

        Raises at once, not at commit time: `ConfigError` when `session` is not hooked by
        `listen`, when it is a sync session on the event loop the bus runs on, or an
        ``AsyncSession`` on another loop than the bus's; and what `EventBus.publish` raises
        for the event without asking Redis: `ConfigError` (topic name, not a pydantic model,
        empty resource ID), `ReservedEventType`, `InvalidEvent` (headers, text),
        `PayloadTooLarge`, `DecompressedTooLarge`.
        """
        sync, is_async = _sync_session(session)
        if self._ended not in sync.dispatch.after_transaction_end:
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
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        envelope = envelope_of(resource_id, event, headers)  # copies the headers
        self.bus.publisher.encoder.prepare_envelope(self.bus.topic(topic), envelope)  # its checks
        queue = self._queue(sync)
        queue.pending.append(Pending(topic, envelope))
        queue.is_async = queue.is_async or is_async

    def pending(self, session: Any) -> list[Pending]:
        """The events `session` has queued through this `AfterCommit` and not yet published
        (a copy)."""
        queue: _Queue | None = _sync_session(session)[0].info.get(self._key)
        return list(queue.pending) if queue else []

    async def flush(self, session: Any) -> list[str]:
        """Wait for the publishes the commits of an ``AsyncSession`` started; returns their
        entry IDs in call order. Raises the first failure (`PublishError`; the database has
        committed). Cancelling the wait does not cancel the publishes."""
        queue: _Queue | None = _sync_session(session)[0].info.get(self._key)
        if queue is None or not queue.started:
            return []
        started, queue.started = queue.started, []
        await asyncio.wait(started)
        return [entry_id for task in started for entry_id in task.result()]

    def _queue(self, session: Session) -> _Queue:
        queue: _Queue | None = session.info.get(self._key)
        if queue is None:
            queue = session.info[self._key] = _Queue()
        return queue

    def _began(self, session: Session, transaction: SessionTransaction) -> None:
        queue: _Queue | None = session.info.get(self._key)
        if transaction.nested and queue is not None:  # (no queue: nothing queued before it)
            queue.marks[transaction] = len(queue.pending)

    def _rolled_back(self, session: Session, previous_transaction: SessionTransaction) -> None:
        """Also called for the subtransaction of a failed flush: the database rolled back to the
        innermost savepoint around it, or the whole transaction."""
        queue: _Queue | None = session.info.get(self._key)
        if queue is None:
            return
        boundary = previous_transaction
        while not boundary.nested and boundary.parent is not None:
            boundary = boundary.parent
        if boundary.nested:  # (a savepoint begun before the queue: nothing queued before it)
            marks = queue.marks
            mark = (
                marks.pop(boundary, 0)
                if boundary is previous_transaction
                else marks.get(boundary, 0)
            )
            del queue.pending[mark:]
        else:
            queue.pending.clear()

    def _committed(self, session: Session) -> None:
        """Also called when a savepoint is released: its events wait for the outermost commit."""
        queue: _Queue | None = session.info.get(self._key)
        if queue is None:
            return
        savepoint = session.get_nested_transaction()  # (still the one released, if any)
        if savepoint is not None:
            queue.marks.pop(savepoint, None)
        else:
            queue.committed += queue.pending
            queue.pending.clear()

    def _ended(self, session: Session, transaction: SessionTransaction) -> None:
        """The end of any transaction: of the outermost one (committed, rolled back, or
        discarded by ``close()``/``reset()``), publish what it committed and drop the rest.
        Called after SQLAlchemy closed the transaction, so that a `PublishError` raised here
        leaves the session usable."""
        queue: _Queue | None = session.info.get(self._key)
        if queue is None:
            return
        if transaction.parent is not None:  # (a savepoint's mark goes with its release/rollback)
            return
        items, queue.committed = queue.committed, []
        queue.pending.clear()
        queue.marks.clear()
        if not items:
            return
        if not queue.is_async:
            self.bus.sync().call(lambda: _publish_all(self.bus, items))
            return
        # an AsyncSession's commit runs on the event loop: it cannot wait here (`flush` does)
        task = asyncio.get_running_loop().create_task(_publish_all(self.bus, items))
        task.add_done_callback(_log_failure)
        queue.started[:] = [t for t in queue.started if not t.done() or _failed(t)]  # flush: them
        queue.started.append(task)


async def _publish_all(bus: EventBus, items: list[Pending]) -> list[str]:
    """Publish `items` concurrently, in call order (each takes its place in the sender's queue
    when started, and tasks start in order); raises the first failure."""
    return list(await asyncio.gather(*(_publish(bus, item) for item in items)))


def _publish(bus: EventBus, item: Pending) -> Awaitable[str]:
    """`EventBus.publish` of an envelope encoded earlier (traced as `Publisher.publish` is)."""
    topic, envelope = bus.topic(item.topic), item.envelope
    send = bus.publisher.publish_envelope
    if hooks.tracing is None:
        return send(topic, envelope)
    return hooks.tracing.publish(
        lambda headers: send(topic, msgspec.structs.replace(envelope, headers=headers)),
        topic.name,
        envelope.headers,
        1,
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
