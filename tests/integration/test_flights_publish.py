"""The flights demo's publish step (`examples.flights.pipeline.publish_flights`) on a real Redis:
the bulk load (the default, ``--batch N``: sequential ``publish_many`` calls), and per-plane order
with concurrent ``publish()`` calls (``--batch 0``: a plane's flight is published only once its
previous one is confirmed)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from eventbus import EventBus, Settings
from eventbus.protocol.codec import decode_entry
from examples.flights.flightdata import FlightRow
from examples.flights.pipeline import DemoOptions, Run, publish_flights
from examples.flights.workers import DemoKeys

pytestmark = pytest.mark.anyio

TOPIC = "flights-test"
PLANES = [f"N{i}" for i in range(5)]


def _rows(n: int) -> list[FlightRow]:
    """`n` flights of few planes (most flights find their plane's previous one in flight)."""
    seqs: dict[str, int] = defaultdict(int)
    rows = []
    for position in range(n):
        plane = PLANES[position * 7 % 11 % len(PLANES)]
        seqs[plane] += 1
        rows.append(
            FlightRow(
                position, seqs[plane], plane, 2013, 1, 1, "2013-01-01T05:00:00Z", 515, 517, 2,
                11, "UA", 1545, plane, "EWR", "IAH", 227, 1400,
            )
        )  # fmt: skip
    return rows


class _Recording:
    """`bus` with each `publish` call's start and confirmation recorded per plane, and each
    `publish_many` call's size."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.events: list[tuple[str, str, int]] = []  # ("call" | "done", plane, seq)
        self.many: list[int] = []
        self.inflight = 0

    async def publish(self, topic: str, event: Any, *, resource_id: str) -> str:
        self.events.append(("call", resource_id, event.seq))
        entry_id = await self.bus.publish(topic, event, resource_id=resource_id)
        self.events.append(("done", resource_id, event.seq))
        return entry_id

    async def publish_many(self, topic: str, events: Any) -> list[str]:
        pairs = list(events)
        self.many.append(len(pairs))
        self.inflight += 1
        assert self.inflight == 1  # one call at a time
        try:
            return await self.bus.publish_many(topic, pairs)
        finally:
            self.inflight -= 1


async def _stream_seqs(r: redis.asyncio.Redis, bus: EventBus) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for shard in range(bus.topic(TOPIC).shards):
        for _, fields in await r.xrange(bus.keys.stream(TOPIC, shard)):
            payload = decode_entry(fields).payload
            out[payload["plane"]].append(payload["seq"])
    return dict(out)


def _run(settings: Settings, rows: list[FlightRow], **options: Any) -> Run:
    run = Run(DemoOptions(**options), settings, TOPIC, DemoKeys(settings.key_prefix, TOPIC))
    run.rows = rows
    return run


async def _published(
    settings: Settings, rows: list[FlightRow], **options: Any
) -> tuple[EventBus, Run, _Recording]:
    """The demo's publish step over `rows` with `options`, through a `_Recording` bus."""
    bus = EventBus(settings)
    run = _run(bus.settings, rows, **options)
    recording = _Recording(bus)
    async with bus:
        await publish_flights(recording, run)  # type: ignore[arg-type]
    return bus, run, recording


async def test_a_planes_flight_is_published_once_its_previous_one_is_confirmed(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rows = _rows(1500)
    bus, run, recording = await _published(
        settings(publish_batch_max=20), rows, window=200, batch=0
    )

    assert run.published == len(rows) == len(run.confirm_ms)
    assert not recording.many  # no publish_many() call
    confirmed: dict[str, int] = defaultdict(int)  # plane -> its last confirmed seq
    for what, plane, seq in recording.events:
        if what == "call":
            assert confirmed[plane] == seq - 1, (plane, seq)  # the previous one confirmed
        else:
            confirmed[plane] = seq
    seqs = await _stream_seqs(r, bus)
    assert seqs == {p: list(range(1, len(seqs[p]) + 1)) for p in PLANES}
    assert sum(map(len, seqs.values())) == len(rows)


async def test_the_batch_option_publishes_every_flight_in_order_with_publish_many(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rows = _rows(1000)
    bus, run, recording = await _published(settings(publish_batch_max=64), rows, batch=300)

    assert recording.many == [300, 300, 300, 100]
    assert not [e for e in recording.events if e[0] == "call"]  # no publish() call
    assert run.published == len(rows) == len(run.confirm_ms)
    seqs = await _stream_seqs(r, bus)
    assert seqs == {p: list(range(1, len(seqs[p]) + 1)) for p in PLANES}
    assert sum(map(len, seqs.values())) == len(rows)


async def test_the_job_bulk_loads_by_default(settings: Callable[..., Settings]) -> None:
    _, run, recording = await _published(settings(), _rows(1200))

    assert recording.many == [500, 500, 200]
    assert run.published == 1200 and run.options.window == 2000  # window unused here


async def test_a_paced_bulk_load_publishes_at_most_a_hundredth_of_the_rate_per_call(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rows = _rows(95)
    bus, _, recording = await _published(settings(), rows, rate=2000.0)

    assert recording.many == [20, 20, 20, 20, 15]  # --rate used to be ignored with --batch
    seqs = await _stream_seqs(r, bus)
    assert seqs == {p: list(range(1, len(seqs[p]) + 1)) for p in PLANES}


def test_a_rows_event_is_the_flight_of_its_fields() -> None:
    from pydantic import ValidationError

    from examples.flights.flightdata import Flight

    for row in _rows(3):
        assert row.event() == Flight(**row._asdict())
        assert row.event().model_dump() == row._asdict()
    with pytest.raises(ValidationError):  # validated, not constructed
        _rows(1)[0]._replace(distance="far").event()
