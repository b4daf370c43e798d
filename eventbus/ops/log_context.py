"""The entry a handler is working on, in the log records it emits: `log_context` (a middleware)
remembers the attempt's `Context` in a context variable for the attempt's duration, and
`HandlerLogFilter` (a `logging.Filter`) copies its ``topic``, ``group``, ``resource_id``,
``entry_id`` and ``event_type`` onto every record logged meanwhile, from any logger, also from
a sync handler's worker thread (anyio runs it in a copy of the context). Records logged outside
a handler get ``"-"``, so a format string may name the fields. ``eventbus run --log-format json``
gives its handler one that adds nothing outside handlers, and `eventbus.ops.logs.JsonFormatter`
prints the fields as it prints every ``extra`` field.

    bus.middleware(log_context)
    handler.addFilter(HandlerLogFilter())  # e.g. logging.getLogger().handlers[0]
    logging.Formatter("%(levelname)s %(topic)s %(resource_id)s %(entry_id)s %(message)s")

For a batch handler the record names the batch: its topic and group, the resource ID when all
its entries share one (else ``"<n> resources"``), and ``"<first>..<last>"`` entry IDs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

FIELDS = ("topic", "group", "resource_id", "entry_id", "event_type")
"""The attributes `HandlerLogFilter` sets on a record."""

_current: ContextVar[Any] = ContextVar("eventbus_handler_context", default=None)


@asynccontextmanager
async def log_context(event: Any, ctx: Any) -> AsyncIterator[None]:
    """A middleware (`EventBus.middleware`): `ctx` (a `Context`, or a batch's list of them) is
    what `HandlerLogFilter` reports while the attempt runs."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


def _fields(ctx: Any) -> dict[str, str]:
    if not isinstance(ctx, list):
        return {f: str(getattr(ctx, f)) for f in FIELDS}
    first, last = ctx[0], ctx[-1]
    resources = {c.resource_id for c in ctx}
    types = {c.event_type for c in ctx}
    return {
        "topic": first.topic,
        "group": first.group,
        "resource_id": first.resource_id if len(resources) == 1 else f"{len(resources)} resources",
        "entry_id": first.entry_id if len(ctx) == 1 else f"{first.entry_id}..{last.entry_id}",
        "event_type": first.event_type if len(types) == 1 else ",".join(sorted(types)),
    }


class HandlerLogFilter(logging.Filter):
    """Adds the entry being handled (`FIELDS`) to each record; see the module docstring. Never
    drops a record, and never replaces an attribute the record already has (an ``extra``).
    `outside` is the value of every field on records logged outside a handler (None: none is
    added to them)."""

    def __init__(self, outside: str | None = "-") -> None:
        super().__init__()
        self._outside = {} if outside is None else dict.fromkeys(FIELDS, outside)

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        fields = self._outside if ctx is None or ctx == [] else _fields(ctx)
        for name, value in fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


__all__ = ["FIELDS", "HandlerLogFilter", "log_context"]
