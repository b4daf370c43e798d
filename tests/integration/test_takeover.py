"""Takeover from a consumer in a real subprocess: after SIGKILL (liveness expires) and after
SIGTERM (graceful: at once). The dead or departed consumer's pending entries must be processed
first, in order, and nothing may be lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Recorder, Tick, resources_per_shard, running, total_pending, wait_until

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]
PROC = Path(__file__).with_name("consumer_proc.py")
TOPIC, GROUP, SHARDS = "flights", "ordered", 4


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start consumer_proc.py with a JSON config; kills what is left at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(settings: Settings, block_from: int, **extra: Any) -> subprocess.Popen[bytes]:
        config = {
            "prefix": "proc",
            "topic": TOPIC,
            "group": GROUP,
            "block_from": block_from,
            "settings": settings.model_dump(mode="json"),
            **extra,
        }
        proc = subprocess.Popen(
            [sys.executable, str(PROC), json.dumps(config)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def _records(r: redis.asyncio.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in await r.lrange(key, 0, -1)]


def _by_resource(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for rec in records:
        out[rec["resource"]].append(rec["seq"])
    return dict(out)


async def _blocked_on_every_resource(
    r: redis.asyncio.Redis, resources: list[str], seq: int
) -> bool:
    started = await _records(r, "proc:started")
    return {x["resource"] for x in started if x["seq"] == seq} == set(resources)


def _consumer(s: Settings, rec: Recorder) -> EventBus:
    bus = EventBus(s)

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    return bus


async def test_sigkilled_consumers_pending_entries_are_recovered_in_order(
    settings: SettingsFactory, r: redis.asyncio.Redis, spawn: Callable[..., Any]
) -> None:
    s = settings(shards=SHARDS, liveness_ttl_s=1.0)
    resources = resources_per_shard(SHARDS, per_shard=2)
    publisher = EventBus(s)
    await publisher.publish_many(
        TOPIC, [(rid, Tick(resource=rid, seq=seq)) for seq in range(7) for rid in resources]
    )

    # The subprocess handles seq 0-2 of every resource and blocks on seq 3: seq 3-6 are read
    # (pending, owned by it) but never acked.
    proc = spawn(s, block_from=3)
    await wait_until(lambda: _blocked_on_every_resource(r, resources, 3), within_s=30)
    pending = len(resources) * 4
    await wait_until(lambda: _pending_is(publisher, r, pending))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL

    dead = await _records(r, "proc:handled")
    assert _by_resource(dead) == {rid: [0, 1, 2] for rid in resources}
    dead_tokens = {x["shard"]: x["token"] for x in dead}
    dead_id = dead[0]["consumer"]

    # new events arrive after the crash; they must come after the recovered ones
    await publisher.publish_many(
        TOPIC, [(rid, Tick(resource=rid, seq=seq)) for seq in range(7, 10) for rid in resources]
    )
    await publisher.aclose()

    rec = Recorder()
    killed_at = time.monotonic()
    async with running(_consumer(s, rec)) as [run]:
        await rec.wait_for(len(resources) * 7, within_s=30)
        await wait_until(lambda: _pending_is(run.bus, r, 0))
    took = time.monotonic() - killed_at

    assert rec.by_resource() == {rid: list(range(3, 10)) for rid in resources}
    # every shard changed owner, with a larger fencing token than the dead consumer's
    for h in rec.log:
        assert h.ctx.fencing_token > dead_tokens[h.ctx.shard]
    assert await r.zscore(run.bus.keys.members(TOPIC, GROUP), dead_id) is None
    # the dead consumer's locks could only be taken once its liveness (1 s) ran out
    assert took >= 0.5


async def _pending_is(bus: EventBus, r: redis.asyncio.Redis, n: int) -> bool:
    return await total_pending(bus, TOPIC, GROUP, r) == n


async def test_sigterm_hands_shards_over_at_once(
    settings: SettingsFactory, r: redis.asyncio.Redis, spawn: Callable[..., Any]
) -> None:
    """A consumer stopped by SIGTERM finishes its running handlers, releases its locks and
    leaves; a waiting consumer takes the shards at its next poll, long before the 30 s TTL,
    and processes the entries the stopped one had read but not started."""
    s = settings(shards=SHARDS, liveness_ttl_s=30.0, block_max_ms=200)
    resources = resources_per_shard(SHARDS, per_shard=2)
    publisher = EventBus(s)
    await publisher.publish_many(
        TOPIC, [(rid, Tick(resource=rid, seq=seq)) for seq in range(4) for rid in resources]
    )
    await publisher.aclose()

    proc = spawn(s, block_from=0)  # every handler waits for the gate
    await wait_until(lambda: _blocked_on_every_resource(r, resources, 0), within_s=30)

    rec = Recorder()
    members = publisher.keys.members(TOPIC, GROUP)
    locks = publisher.keys.locks(TOPIC, GROUP)
    async with running(_consumer(s, rec)) as [run]:
        await wait_until(lambda: _zcard_is(r, members, 2))
        assert rec.log == []  # the live subprocess holds every shard

        proc.send_signal(signal.SIGTERM)
        # once it is stopping (it then starts no more handlers), let its running ones finish
        await wait_until(lambda: r.exists("proc:stopping"))
        await r.set("proc:gate", 1)
        assert await anyio.to_thread.run_sync(proc.wait, 20) == 0
        left_at = time.monotonic()
        owners = await r.hgetall(locks)
        assert not [
            k for k, v in owners.items() if b":" not in k and v != run.consumer_ids[0].encode()
        ]
        assert await r.zcard(members) == 1

        await rec.wait_for(len(resources) * 3, within_s=10)
        took = time.monotonic() - left_at
        await wait_until(lambda: _pending_is(run.bus, r, 0))

    assert _by_resource(await _records(r, "proc:handled")) == {rid: [0] for rid in resources}
    assert rec.by_resource() == {rid: [1, 2, 3] for rid in resources}
    assert took < 5, f"takeover took {took:.2f} s"


async def _zcard_is(r: redis.asyncio.Redis, key: str, n: int) -> bool:
    return await r.zcard(key) == n


async def test_paused_consumer_past_its_ttl_is_fenced_out(
    settings: SettingsFactory, r: redis.asyncio.Redis, spawn: Callable[..., Any]
) -> None:
    """SIGSTOP a consumer in the middle of long handlers for longer than its liveness TTL:
    another consumer takes its shards (larger fencing tokens) and processes everything. Resumed,
    the paused one finishes the handlers it was in (their writes carry the old token; the
    handlers make no Redis call, so it learns nothing from Redis before they return), but must
    start nothing else: its lease ran out while it was paused."""
    s = settings(shards=SHARDS, liveness_ttl_s=1.0)
    resources = resources_per_shard(SHARDS, per_shard=1)
    publisher = EventBus(s)
    await publisher.publish_many(
        TOPIC, [(rid, Tick(resource=rid, seq=seq)) for seq in range(4) for rid in resources]
    )
    await publisher.aclose()

    hold_s = 1.5
    proc = spawn(s, block_from=99, hold_below=1, hold_s=hold_s)  # seq 0 takes 1.5 s
    await wait_until(lambda: _blocked_on_every_resource(r, resources, 0), within_s=30)
    proc.send_signal(signal.SIGSTOP)
    try:
        started = await _records(r, "proc:started")
        assert {x["seq"] for x in started} == {0}, "paused too late: raise hold_s"
        paused_id = started[0]["consumer"]
        rec = Recorder()
        async with running(_consumer(s, rec)) as [run]:
            await rec.wait_for(len(resources) * 4, within_s=30)
            await wait_until(lambda: _pending_is(run.bus, r, 0))

            # resume once its handlers' time is up, so they return at once
            done_at = max(x["t"] for x in started) + hold_s + 0.05
            await wait_until(lambda: time.time() > done_at)
            proc.send_signal(signal.SIGCONT)
            await wait_until(lambda: _handled_count_is(r, len(resources)))
            await wait_until(lambda: _is_member(r, run.bus, paused_id))  # it heartbeat again
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    assert rec.by_resource() == {rid: [0, 1, 2, 3] for rid in resources}
    started = await _records(r, "proc:started")
    assert sorted((x["resource"], x["seq"]) for x in started) == [
        (rid, 0) for rid in sorted(resources)
    ]
    new_tokens = {h.ctx.shard: h.ctx.fencing_token for h in rec.log}
    for x in await _records(r, "proc:handled"):
        assert x["token"] < new_tokens[x["shard"]]
    assert await total_pending(run.bus, TOPIC, GROUP, r) == 0


async def _handled_count_is(r: redis.asyncio.Redis, n: int) -> bool:
    return await r.llen("proc:handled") == n


async def _is_member(r: redis.asyncio.Redis, bus: EventBus, consumer_id: str) -> bool:
    return await r.zscore(bus.keys.members(TOPIC, GROUP), consumer_id) is not None


async def test_pending_entries_of_many_shards_are_recovered_with_their_delivery_counts(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """A consumer that takes several shards at once, each with entries pending for a consumer
    gone without releasing them, handles them all, in order, with their delivery counts (each
    read once before: 2), read for all the shards in one pipeline."""
    shards = 4
    bus = EventBus(settings(shards=shards))
    rec = Recorder()
    bus.subscriber(TOPIC, group=GROUP)(rec.add)
    names = resources_per_shard(shards)
    for s in range(shards):
        await r.xgroup_create(bus.keys.stream(TOPIC, s), GROUP, id="0", mkstream=True)
    for seq in range(3):
        for name in names:
            stream, fields = bus.publisher.encoder.prepare(
                bus.topic(TOPIC), Tick(resource=name, seq=seq), name
            )
            await r.xadd(stream, fields)
    for s in range(shards):  # read by a consumer name that holds no lock: left pending
        got = await r.xreadgroup(GROUP, "gone", {bus.keys.stream(TOPIC, s): ">"}, count=100)
        assert len(got[0][1]) == 3
    async with running(bus):
        await rec.wait_for(3 * shards)
    assert rec.by_resource() == {name: [0, 1, 2] for name in names}
    assert [h.ctx.delivery_count for h in rec.log] == [2] * (3 * shards)
