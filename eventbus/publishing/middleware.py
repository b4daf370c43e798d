"""Publish middlewares: outgoing hooks, beside the handlers' (`eventbus.consumer.scope`).

A publish middleware (``@bus.publish_middleware``) is a function ``mw(message)`` returning an
async context manager, entered around each `EventBus.publish` (and so each `Context.publish`
and ``bus.sync().publish``): the code before its ``yield`` may change the `Outgoing` message
(add a header, say: ``message.headers["tenant"] = ...``), the code after it sees the entry ID
the publish got (`Outgoing.entry_id`), and an ``except`` around the ``yield`` sees what the
publish raised (re-raise it: a middleware cannot turn a failed publish into a success, the
caller would get no entry ID). They nest in registration order, the first outermost. An
exception raised by a middleware is raised to the caller; nothing is published when it is
raised before the ``yield``.

A bus without publish middlewares pays nothing for them: `EventBus.publish` tests one list.
``publish_many``, ``request`` and the outbox relay do not enter them (they send envelopes or
batches of their own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field

from pydantic import BaseModel


@dataclass(slots=True)
class Outgoing:
    """One event on its way out: what a publish middleware may read and change before the
    send (`topic`, `event`, `resource_id`, `headers`), and `entry_id` after it (None before)."""

    topic: str
    event: BaseModel
    resource_id: str
    headers: dict[str, str] = field(default_factory=dict)
    entry_id: str | None = None


PublishMiddleware = Callable[[Outgoing], AbstractAsyncContextManager[object]]
"""``mw(message)`` -> an async context manager entered around one publish."""


async def through(
    middlewares: list[PublishMiddleware],
    message: Outgoing,
    send: Callable[[Outgoing], Awaitable[str]],
) -> str:
    """``send(message)`` inside `middlewares` (the first the outermost), which may change
    `message` first; its entry ID, also set on `message` before the middlewares exit."""
    async with AsyncExitStack() as stack:
        for mw in tuple(middlewares):
            await stack.enter_async_context(mw(message))
        message.entry_id = await send(message)
        return message.entry_id


__all__ = ["Outgoing", "PublishMiddleware", "through"]
