"""Optional instrumentation, off unless enabled: the hot paths test one module attribute.

`tracing` is set by `eventbus.otel.instrument` (OpenTelemetry) and reset by `uninstrument`; while
it is None nothing else runs and nothing is imported. `Publisher.publish` / `publish_many` and
`Handling.attempt` are its only callers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from eventbus.consumer.context import Context

T = TypeVar("T")


class Tracing(Protocol):
    def publish(
        self,
        send: Callable[[dict[str, str]], Awaitable[T]],
        topic: str,
        headers: dict[str, str] | None,
        count: int,
    ) -> Awaitable[T]:
        """Run ``send(headers)`` (a publish of `count` events on `topic`) in a producer span,
        with the trace context added to a copy of `headers`."""
        ...

    def consume(
        self, call: Callable[[Any, Context], Awaitable[Any]], event: Any, ctx: Context
    ) -> Awaitable[Any]:
        """Run ``call(event, ctx)`` (a handler attempt) in a consumer span continuing the trace
        context of ``ctx.headers``."""
        ...


tracing: Tracing | None = None
