"""OpenTelemetry: the trace context travels in the entry headers from the producer span of a publish
to the consumer span of the handler, with the messaging semantic conventions; nothing is traced once
uninstrumented. Uses the SDK's in-memory span exporter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support import Recorder, Tick, running

from eventbus import Context, EventBus, otel
from eventbus.config import Settings
from eventbus.ops import hooks

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(provider)
    yield exporter
    otel.uninstrument()
    assert hooks.tracing is None


async def test_trace_context_flows_from_publish_to_handler(
    settings: type[Settings], spans: InMemorySpanExporter
) -> None:
    bus = EventBus(settings())
    rec = Recorder()
    seen_parent: list[trace.SpanContext] = []

    @bus.subscriber("traced", group="billing")
    async def handle(event: Tick, ctx: Context) -> None:
        seen_parent.append(trace.get_current_span().get_span_context())
        rec.add(event, ctx)

    async with running(bus):
        entry_id = await bus.publish("traced", Tick(resource="r1", seq=1), resource_id="r1")
        await rec.wait_for(1)
    ctx = rec.log[0].ctx
    assert "traceparent" in ctx.headers
    finished = {s.name: s for s in spans.get_finished_spans()}
    producer, consumer = finished["send traced"], finished["process traced"]
    assert producer.kind is SpanKind.PRODUCER and consumer.kind is SpanKind.CONSUMER
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None and consumer.parent.span_id == producer.context.span_id
    assert seen_parent[0].span_id == consumer.context.span_id  # the handler runs in the span
    assert producer.attributes == {
        "messaging.system": "redis",
        "messaging.destination.name": "traced",
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.message.id": entry_id,
    }
    attrs = consumer.attributes or {}
    assert attrs["messaging.system"] == "redis"
    assert attrs["messaging.destination.name"] == "traced"
    assert attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.message.id"] == entry_id == ctx.entry_id
    assert attrs["messaging.consumer.group.name"] == "billing"
    assert attrs["messaging.destination.partition.id"] == str(ctx.shard)


async def test_a_publish_inside_a_span_continues_its_trace_and_failures_are_errors(
    settings: type[Settings], spans: InMemorySpanExporter
) -> None:
    bus = EventBus(settings(max_attempts=2))
    rec = Recorder()

    @bus.subscriber("traced", group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)
        if ctx.attempt == 1:
            raise ValueError("first attempt fails")

    tracer = otel.hooks.tracing.tracer  # type: ignore[union-attr]
    async with running(bus):
        with tracer.start_as_current_span("web request") as request_span:
            await bus.publish_many("traced", [("a", Tick(resource="a", seq=1))])
        await rec.wait_for(2)
    trace_id = request_span.get_span_context().trace_id
    finished = spans.get_finished_spans()
    producer = next(s for s in finished if s.name == "send traced")
    assert producer.context.trace_id == trace_id
    assert producer.parent is not None
    assert producer.parent.span_id == request_span.get_span_context().span_id
    attempts = [s for s in finished if s.name == "process traced"]
    assert [s.attributes["eventbus.attempt"] for s in attempts] == [1, 2]  # type: ignore[index]
    assert all(s.context.trace_id == trace_id for s in attempts)
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert attempts[0].events[0].name == "exception"
    assert attempts[1].status.status_code is StatusCode.UNSET


async def test_nothing_is_traced_or_added_to_headers_when_off(settings: type[Settings]) -> None:
    assert hooks.tracing is None
    bus = EventBus(settings())
    rec = Recorder()

    @bus.subscriber("plain", group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    async with running(bus):
        await bus.publish("plain", Tick(resource="r", seq=1), resource_id="r")
        await rec.wait_for(1)
    assert rec.log[0].ctx.headers == {}
