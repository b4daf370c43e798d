"""OpenTelemetry tracing (``pip install eventbus[otel]``): W3C trace context in the entry headers.

``eventbus.otel.instrument()`` (once, at start-up, after configuring your tracer provider) makes
every publish a *producer* span whose context is injected into the entry's headers
(``traceparent``, ``tracestate``, by the globally configured propagator) and every handler
attempt a *consumer* span whose parent is extracted from them, so a trace follows an event from
the web request that published it to the handler that processed it, across services. Spans
follow OpenTelemetry's messaging semantic conventions:

==================================  ===============================  ==========================
attribute                           producer (``send <topic>``)      consumer (``process <topic>``)
==================================  ===============================  ==========================
``messaging.system``                ``redis``                        ``redis``
``messaging.destination.name``      the topic                        the topic
``messaging.operation.name/type``   ``send``                         ``process``
``messaging.message.id``            the entry ID (once stored)       the entry ID
``messaging.consumer.group.name``                                    the group
``messaging.destination.partition.id``                               the shard
``messaging.batch.message_count``   events of a ``publish_many``
==================================  ===============================  ==========================

A handler that raises marks its span as an error (the exception is recorded). Batch handlers
(``batch=True``) get no consumer span: one call takes many events, each with its own trace
context, and none is joined. Without
`instrument` nothing of this module runs and OpenTelemetry is not imported: the publish and
handler paths test one attribute (`eventbus.ops.hooks.tracing`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from eventbus.errors import extra_missing
from eventbus.ops import hooks

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind
except ImportError as exc:
    raise extra_missing("eventbus.otel", "otel", exc) from exc

if TYPE_CHECKING:
    from eventbus.consumer.context import Context

T = TypeVar("T")

SYSTEM = "redis"


class OtelTracing:
    """The `eventbus.ops.hooks.Tracing` of OpenTelemetry, with one tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    async def publish(
        self,
        send: Callable[[dict[str, str]], Awaitable[T]],
        topic: str,
        headers: dict[str, str] | None,
        count: int,
    ) -> T:
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.destination.name": topic,
            "messaging.operation.name": "send",
            "messaging.operation.type": "send",
        }
        if count != 1:
            attributes["messaging.batch.message_count"] = count
        with self.tracer.start_as_current_span(
            f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            carrier = dict(headers or {})
            propagate.inject(carrier)
            result = await send(carrier)
            if isinstance(result, str):
                span.set_attribute("messaging.message.id", result)
            return result

    async def consume(
        self, call: Callable[[Any, Context], Awaitable[Any]], event: Any, ctx: Context
    ) -> Any:
        parent = propagate.extract(ctx.headers)
        with self.tracer.start_as_current_span(
            f"process {ctx.topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.destination.name": ctx.topic,
                "messaging.operation.name": "process",
                "messaging.operation.type": "process",
                "messaging.message.id": ctx.entry_id,
                "messaging.consumer.group.name": ctx.group,
                "messaging.destination.partition.id": str(ctx.shard),
                "eventbus.resource_id": ctx.resource_id,
                "eventbus.event_type": ctx.event_type,
                "eventbus.attempt": ctx.attempt,
            },
        ):
            return await call(event, ctx)


def instrument(tracer_provider: trace.TracerProvider | None = None) -> None:
    """Trace every publish and handler attempt of this process from now on (see the module
    docstring). `tracer_provider`: default the global one (``trace.set_tracer_provider``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("eventbus")
    except PackageNotFoundError:  # pragma: no cover - a source checkout without metadata
        ours = None
    hooks.tracing = OtelTracing(trace.get_tracer("eventbus", ours, tracer_provider))


def uninstrument() -> None:
    """Stop tracing: the publish and handler paths are back to no instrumentation at all."""
    hooks.tracing = None


__all__ = ["OtelTracing", "instrument", "uninstrument"]
