"""Call-order publishing when Redis ran the XADDs but their replies were lost.

`tests/integration/test_publish_order.py` holds pipelines unexecuted under ``CLIENT PAUSE WRITE``;
here they are executed and only the replies are lost, as when a connection drops after Redis
wrote: the chaos harness's TCP proxy (``stress/proxy.py``) holds every reply, and once Redis has
run the batches on the wire the connections are closed under the publisher. The publisher cannot
know what landed, so it sends those batches again: their events then have two copies. What must
hold: every call returns (no error) the entry ID of a copy of its own event, no event is missing,
and per resource the first copies are in call order (Kafka's producer without idempotence gives
the same per partition)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis.asyncio
from support import Tick, wait_until
from test_publish_order import RESOURCES, _entries, _first_copies, _out_of_order

from eventbus import EventBus, Settings
from localredis.server import RedisServer

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def _load_proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stress_proxy", ROOT / "stress" / "proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


proxy = sys.modules.get("stress_proxy") or _load_proxy()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def link(server: RedisServer) -> Iterator[Any]:
    hub = proxy.ProxyHub()
    try:
        yield hub.start(server.port)
    finally:
        hub.close()


async def _stream_total(r: redis.asyncio.Redis, bus: EventBus, topic: str) -> int:
    return sum([await r.xlen(bus.keys.stream(topic, s)) for s in range(bus.topic(topic).shards)])


async def test_call_order_holds_when_executed_batches_lose_their_replies(
    server: RedisServer, link: Any, caplog: pytest.LogCaptureFixture
) -> None:
    calls, pipelines, batch = 2_000, 4, 20
    bus = EventBus(
        Settings(
            redis_url=f"redis://127.0.0.1:{link.port}",
            shards=4,
            publish_batch_max=batch,
            publish_pipelines=pipelines,
            publish_timeout_s=240,
        )
    )
    r = redis.asyncio.Redis(port=server.port)  # straight to Redis, not through the proxy
    caplog.set_level(logging.WARNING, logger="eventbus")
    try:
        async with bus:
            await bus.publish("lost", Tick(resource="setup", seq=-1), resource_id="setup")
            link.set(down_ms=600_000)  # Redis's replies are held by the proxy from now on
            wave = asyncio.gather(
                *(
                    bus.publish("lost", Tick(resource=rid, seq=i), resource_id=rid)
                    for i in range(calls)
                    for rid in [RESOURCES[i % len(RESOURCES)]]
                )
            )

            async def batches_ran() -> bool:
                # Redis ran at least a batch's worth (the publisher sends at most
                # `publish_pipelines` batches before a reply comes: none will)
                return await _stream_total(r, bus, "lost") >= 1 + batch

            await wait_until(batches_ran, within_s=60)
            # the XADDs ran; now the connections drop with their replies unread
            link.blackhole()
            link.set()
            link.heal(drop=True)
            ids = await wave
        entries = await _entries(r, bus, "lost")
        total = await _stream_total(r, bus, "lost")
        seqs = await _first_copies(r, bus, "lost")
    finally:
        await r.aclose()
    retried = [m for m in caplog.messages if m.startswith("XADD pipeline failed")]
    assert retried, caplog.messages
    # the executed batches were sent again: the case under test happened
    assert total > calls + 1
    rids = [RESOURCES[i % len(RESOURCES)] for i in range(calls)]
    assert [entries.get(key) for key in zip(rids, ids, strict=True)] == list(range(calls))
    seqs.pop("setup")
    assert sum(map(len, seqs.values())) == calls
    assert _out_of_order(seqs) == 0
