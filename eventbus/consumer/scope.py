"""What the handlers of one bus share besides their events (`HandlerScope`): the bus's `State`,
the publish function behind `Context.publish`, and the middlewares entered around every handler
attempt.

**Middlewares** (``@bus.middleware``) are functions ``mw(event, ctx)`` that return an async
context manager (an ``@contextlib.asynccontextmanager`` function, say), entered right before an
attempt's handler call and left right after it: the code before its ``yield`` runs before the
handler, the code after it once the handler returned, and an ``except`` around the ``yield``
sees what the handler raised (re-raise it, or the attempt counts as a success). They are entered
in registration order (the first registered is the outermost) around every attempt of every
handler of the bus, single, batch (then `event` and `ctx` are the lists the batch handler gets)
and broadcast, and also during catch-up. An exception raised by a middleware fails the attempt
like the handler's own (retried, then dead-lettered). A bus without middlewares pays nothing for
them: the consumer tests one attribute per attempt.

**Correlation and causation** (`Context.publish`): an event published from a handler carries
`CAUSATION_ID`, the handled event's ID, and `CORRELATION_ID`, the handled event's correlation ID
(or, for the first event of a chain, its own ID), so ``eventbus tail`` and traces can follow a
chain of events back to the one that started it (Greg Young's correlation/causation IDs). The
correlation header is the one request/reply uses (`eventbus.protocol.replies`): events published
while answering a request belong to the request's chain.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, Unpack

from pydantic import BaseModel

from eventbus.protocol.replies import CORRELATION_ID
from eventbus.publishing.publisher import PublishOptions

CAUSATION_ID = "eventbus-causation-id"
"""Header of an event published by a handler (`Context.publish`): the ID of the event handled."""

Middleware = Callable[[Any, Any], AbstractAsyncContextManager[object]]
"""``mw(event, ctx)`` -> an async context manager entered around one handler attempt."""


class Publish(Protocol):
    """``EventBus.publish``, as a handler's `Context.publish` calls it."""

    async def __call__(
        self, topic: str, event: BaseModel, **options: Unpack[PublishOptions]
    ) -> str: ...


class State:
    """Attributes a service sets once and its handlers read (``bus.state.pool = await
    create_pool()`` in an ``on_startup`` hook, ``ctx.state.pool`` in a handler), as Starlette's
    ``app.state``: handlers stop reaching for module globals. Reading an attribute never set
    raises `AttributeError` naming it."""

    def __getattr__(self, name: str) -> Any:  # only called for attributes never set
        raise AttributeError(
            f"bus.state has no attribute {name!r}: set it before the handlers run (e.g. "
            "bus.state.pool = ... in an on_startup hook)"
        )

    def __repr__(self) -> str:
        return f"State({', '.join(sorted(vars(self)))})"


@dataclass(slots=True, eq=False)
class HandlerScope:
    """One per bus, shared by its subscriptions: `state`, `publish` (the bus's, for
    `Context.publish`; None where there is no bus) and `middlewares`, in registration order (a
    consumer takes them when it starts)."""

    state: State = field(default_factory=State)
    publish: Publish | None = None
    middlewares: list[Middleware] = field(default_factory=list)


async def around(
    middlewares: tuple[Middleware, ...], call: Callable[[Any, Any], Any], event: Any, ctx: Any
) -> Any:
    """``await call(event, ctx)`` inside `middlewares` (the first the outermost); its result."""
    async with AsyncExitStack() as stack:
        for mw in middlewares:
            await stack.enter_async_context(mw(event, ctx))
        return await call(event, ctx)


def chained_headers(
    handled: dict[str, str], event_id: str, headers: dict[str, str] | None
) -> dict[str, str]:
    """The headers of an event published while handling the event `event_id` whose headers are
    `handled`: its correlation and causation IDs (module docstring), then `headers` (which may
    set either)."""
    chained = {CORRELATION_ID: handled.get(CORRELATION_ID) or event_id, CAUSATION_ID: event_id}
    if headers:
        chained.update(headers)
    return chained


__all__ = ["CAUSATION_ID", "HandlerScope", "Middleware", "State", "around", "chained_headers"]
