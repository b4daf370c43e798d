"""Before/after measurements of the per-event paths, ratios from one run.

    python stress/perf.py consume [--events N] [--runs 3] [--profile F.svg]
    python stress/perf.py publish [--events N] [--runs 3] [--profile F.svg]
    python stress/perf.py path|core [--events N] [--runs 5]
    python stress/perf.py consume-redis [--events N] [--runs 1] [--rate R]
    python stress/perf.py publish-core [--events N] [--runs 1] [--profile F.callgrind]
    python stress/perf.py flights-publish [--events N] [--runs 1] [--batch]
    python stress/perf.py flights-consume [--events N] [--runs 1] [--group G] [--profile F]
    python stress/perf.py trickle [--events N] [--runs 1]
    python stress/perf.py batch-redis [--events N] [--runs 1] [--profile F.callgrind]
    python stress/perf.py batch-core [--events N] [--runs 1]

``--json F`` writes the last run's figures (stress/ab.py reads them).

``consume``: on a fresh private redis-server, the raw XREADGROUP+XACK+decode loop (bench step 3),
then eventbus publishes the events and one consumer process (bench step 5, no-op handler typed
with a pydantic model) drains them; prints both rates and their ratio. ``publish``: the raw
pipelined XADD loop (bench step 2) and eventbus ``publish()`` from 1000 concurrent tasks (step 4).
``path``: no Redis, the CPU cost per event of the consumer's handling path alone
(`Handling.step` on entries decoded from bytes, with a fence that always holds: decode,
validate, Context, timeout scope, metrics, the no-op handler), in µs per event.
``consume-redis``: a child process publishes N events to a fresh private redis-server, then
this process alone runs one consumer (bench step 5's) until it has handled them: this process
does nothing else, so ``valgrind --tool=callgrind`` on it counts the consumer's instructions
(Redis and the publisher are other processes, not traced); run at two sizes, the difference
over the difference in events is the consumer's instructions per event, start-up cancelled.
It also prints the consumer's Redis calls per event by command (``INFO commandstats``).
With ``--rate R`` the child publishes at R events/s while the consumer runs (after it joined its
group), as the bench's latency step does: read rounds then carry a few events each, and the
callgrind difference of two sizes over the difference in ``calls_xreadgroup`` gives the
instructions per read round (under callgrind the consumer runs ~50 x slower: scale R down so
that rounds carry as many events as at the real rate).
``publish-core``: CPU *instructions* per ``publish()`` (valgrind's callgrind, deterministic on a
shared machine, unlike a rate): the bench's publish from 1000 concurrent tasks runs under
callgrind for N and for 3 N events against a private redis-server (outside valgrind), and the
difference of the two instruction counts over 2 N events is reported, so start-up, imports and
warm-up cancel out. ``--profile F`` keeps the 3 N run's callgrind file (``callgrind_annotate F``).
``flights-publish``: the same N / 3 N callgrind difference for the flights demo's publish step
(`examples.flights.pipeline.publish_flights` over the first rows in publish order, 16 shards, no
consumers). Without ``--batch`` it measures the job's concurrent mode (``--batch 0``: 2,000
tasks calling ``bus.publish``), split in three runs: ``events`` builds each row's `Flight` only,
``direct`` runs the 2,000 tasks calling ``bus.publish`` without the step's per-plane waits
(+ ``bus.publish``, its flusher, the tasks), ``full`` the step itself (+ its per-plane futures and
waits); instructions per event of each part (the differences) and in all. ``--batch``: the
job's default bulk load (sequential ``publish_many`` calls of 500 flights) against ``events``.
The rows are loaded once, outside callgrind.
``flights-consume``: callgrind instructions per handled event of one flights worker
(`examples.flights.workers.run_worker`, unchanged) consuming N and then 3 N flights that a
child published beforehand (the job's bulk load, 16 shards) to a private redis-server: the
difference over 2 N. ``--group`` order-check, aggregate or both (default: both, one pair of
runs each): ``order-check`` measures the per-event consumer path (one handler call per flight,
the handlers' script calls coalesced into one ``EVALSHA`` per batch by the example's
`Batcher`), ``aggregate`` the batch path (one handler call and one ``EVALSHA`` per batch of a
shard's entries); both with ``read_linger_ms`` 30. The worker stops once its group's counters
say N were handled (polled every 0.5 s; SIGTERM to itself, so the graceful shutdown drains the
acks). ``--profile F`` keeps each group's 3 N callgrind file as F.<group>
(``callgrind_annotate --inclusive=yes``).
``trickle``: the consumer's in-process path (as ``core``) at a trickle: its `concurrency`
workers running as in a consumer, and reads of one entry each, every one handled before the
next is dispatched, so that every read finds the workers idle (a consumer's rounds at a low
rate); µs per event. No Redis and no timing: run it under callgrind at N and 3 N events for
instructions per read of one entry.
``batch-redis``: a batch subscriber (``max_batch=500``, no-op) draining N events published
beforehand, in a child process: once plainly (its rate, CPU share of the handled window, time
its event loop sat in ``epoll_wait`` within that window per 1,000 events, i.e. waiting for
Redis, and Redis calls per 1,000 events by command), then under callgrind at N / 25 and
3 N / 25 events (instructions per event, the difference over their difference). ``--profile F``
keeps the larger run's callgrind file.
``batch-core``: a batch subscription's in-process path (as ``core``, with a no-op
``max_batch=500`` handler and one of its workers running), µs per event; under callgrind at N
and 3 N events, instructions per event.
With ``--profile``, the measured eventbus side runs under ``py-spy record`` (SVG flame graph,
or py-spy's raw collapsed stacks when the name ends in ``.txt``); its rate is then lower.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import bench
from bench import RedisServer  # (this checkout's, whatever eventbus is under test)

PY_SPY = str(Path(sys.executable).with_name("py-spy"))
VALGRIND = shutil.which("valgrind") or "valgrind"


def _spy(out: str) -> list[str]:
    fmt = ["--format", "raw"] if out.endswith(".txt") else []
    return [PY_SPY, "record", "-r", "250", "-o", out, *fmt, "--"]


def consume(events: int, profile: str | None) -> dict[str, float]:
    with RedisServer() as server:
        asyncio.run(bench.raw_xadd(server.url, events))  # what the raw read loop drains
        raw = asyncio.run(bench.raw_read_ack(server.url, events))
    with RedisServer() as server:
        asyncio.run(bench.eventbus_publish(server.url, events))
        out = Path("/tmp") / f"perf-consume-{time.time_ns()}.json"
        cmd = [sys.executable, bench.__file__, "_consumer", server.url, str(events + 1), str(out)]
        subprocess.run(
            [*(_spy(profile) if profile else []), *cmd], check=True, capture_output=bool(profile)
        )
        got = json.loads(out.read_text())
        out.unlink()
    return {
        "raw_read_ack_per_s": raw,
        "consume_per_s": got["events_per_s"],
        "ratio": got["events_per_s"] / raw,
    }


def _publish_child(url: str, events: int, out: str) -> None:
    Path(out).write_text(json.dumps(asyncio.run(bench.eventbus_publish(url, events))))


def publish(events: int, profile: str | None) -> dict[str, float]:
    with RedisServer() as server:
        raw = asyncio.run(bench.raw_xadd(server.url, events))
    with RedisServer() as server:
        out = Path("/tmp") / f"perf-publish-{time.time_ns()}.json"
        cmd = [sys.executable, __file__, "_publish", server.url, str(events), str(out)]
        subprocess.run(
            [*(_spy(profile) if profile else []), *cmd], check=True, capture_output=bool(profile)
        )
        rate = float(out.read_text())
        out.unlink()
    return {"raw_xadd_pipelined_per_s": raw, "publish_per_s": rate, "ratio": rate / raw}


def _paced_child(url: str, events: int, rate: float) -> None:
    """Publish `events` events at `rate` events/s once the bench group has a live consumer."""
    import anyio

    async def run() -> None:
        bus = bench.EventBus(bench.Settings(redis_url=url, shards=bench.SHARDS))
        async with bus:
            members = bus.keys.members(bench.TOPIC, "bench")
            while not await bus.redis.zcard(members):  # noqa: ASYNC110 (state in Redis)
                await anyio.sleep(0.05)
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(events):
                    event = bench._event(i)
                    tg.start_soon(
                        lambda e=event, i=i: bus.publish(bench.TOPIC, e, resource_id=f"r{i % 500}")
                    )
                    delay = start + (i + 1) / rate - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)

    anyio.run(run)


def consume_redis(events: int, profile: str | None, rate: float = 0) -> dict[str, float]:
    if profile:
        raise SystemExit("consume-redis runs in this process: profile it from outside")
    with RedisServer() as server:
        out = Path("/tmp") / f"perf-consume-redis-{time.time_ns()}.json"
        paced = None
        if rate:  # published while the consumer runs, at `rate`
            cmd = [sys.executable, __file__, "_paced", server.url, str(events + 1), str(rate)]
            paced = subprocess.Popen(cmd, env=bench.child_env())
        else:
            cmd = [sys.executable, __file__, "_publish", server.url, str(events), str(out)]
            subprocess.run(cmd, check=True, env=bench.child_env())  # events + 1 (a warm-up)
            out.unlink()
        before = asyncio.run(bench.command_calls(server.url))
        reads = asyncio.run(_reads_processed(server.url))
        bench.consumer_main(server.url, events + 1, str(out))
        if paced is not None and paced.wait():
            raise RuntimeError(f"the paced publisher failed ({paced.returncode})")
        reads = asyncio.run(_reads_processed(server.url)) - reads - 2  # 2: the INFOs here
        after = asyncio.run(bench.command_calls(server.url))
        got = json.loads(out.read_text())
        out.unlink()
    calls = {c: n - before.get(c, 0) for c, n in after.items() if n > before.get(c, 0)}
    calls.pop("info", None)  # the count itself
    return {
        "consume_per_s": got["events_per_s"],
        "round_trips": reads,
        "round_trips_per_1k_events": reads / (events + 1) * 1000,
        **{f"calls_{c}": n for c, n in sorted(calls.items())},
    }


async def _reads_processed(url: str) -> int:
    """The server's read events so far (``INFO stats`` total_reads_processed): one per command
    or pipeline a client sent, i.e. per round trip, while pipelines fit one socket read."""
    r = bench.aioredis.Redis.from_url(url)
    stats = await r.info("stats")
    await r.aclose()
    return int(stats["total_reads_processed"])


def _callgrind_instructions(
    url: str, events: int, keep: str | None, child: list[str] | None = None
) -> int:
    """Instructions (callgrind's ``Ir``) of one ``_publish`` child publishing `events` events
    (or of the `child` command line given to this script)."""
    out = Path("/tmp") / f"perf-publish-core-{time.time_ns()}"
    cg = keep or f"{out}.callgrind"
    cmd = [VALGRIND, "--tool=callgrind", f"--callgrind-out-file={cg}", "--dump-instr=no"]
    cmd += [sys.executable, __file__, *(child or ["_publish", url, str(events), f"{out}.json"])]
    # callgrind runs the child ~50x slower: no publish may time out meanwhile
    env = {**os.environ, "EVENTBUS_PUBLISH_TIMEOUT_S": "3600"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        Path(cg).unlink(missing_ok=True)
        raise RuntimeError(f"callgrind run of {events} events failed:\n{done.stderr[-3000:]}")
    Path(f"{out}.json").unlink(missing_ok=True)
    text = Path(cg).read_text()
    if not keep:
        Path(cg).unlink()
    totals = [line for line in text.splitlines() if line.startswith(("totals:", "summary:"))]
    return int(totals[-1].split()[1])


def publish_core(events: int, profile: str | None) -> dict[str, float]:
    """Instructions per `publish()` call: callgrind runs of N and 3 N events, the difference
    over 2 N (see the module docstring)."""
    counts = []
    for n, keep in ((events, None), (3 * events, profile)):
        with RedisServer() as server:
            counts.append(_callgrind_instructions(server.url, n, keep))
    return {
        "instructions_small": counts[0],
        "instructions_large": counts[1],
        "instructions_per_event": (counts[1] - counts[0]) / (2 * events),
    }


def _flights_child(variant: str, url: str, events: int, rows_file: str) -> None:
    """Run the flights publish step's `variant` (see `flights_publish`) over `events` rows."""
    import pickle

    import anyio

    from eventbus.app import EventBus
    from examples.flights import pipeline
    from examples.flights.workers import DemoKeys, settings_for

    rows = pickle.loads(Path(rows_file).read_bytes())[:events]
    if variant == "events":
        for row in rows:
            row.event()
        return
    settings = settings_for(url, 16)
    # "full-batch": the job's default bulk load; "direct"/"full": its concurrent mode (batch 0)
    options = pipeline.DemoOptions(batch=500 if variant.endswith("-batch") else 0)
    run = pipeline.Run(options, settings, "flights-perf", DemoKeys(settings.key_prefix, "x"))
    run.rows = rows

    async def direct(bus: EventBus) -> None:  # the step's tasks without its per-plane waits
        it = iter(rows)

        async def task() -> None:
            for row in it:
                await bus.publish(run.topic, row.event(), resource_id=row.plane)

        async with anyio.create_task_group() as tg:
            for _ in range(min(options.window, len(rows))):
                tg.start_soon(task)

    async def main() -> None:
        bus = EventBus(settings)
        async with bus:
            if variant == "direct":
                await direct(bus)
            else:
                await pipeline.publish_flights(bus, run)
        await bus.aclose()

    asyncio.run(main())


def flights_publish(events: int, profile: str | None, batch: bool = False) -> dict[str, float]:
    """Instructions per event of the flights publish step and its parts (module docstring)."""
    import pickle

    from examples.flights.flightdata import load_flights

    rows_file = Path("/tmp") / f"perf-flights-rows-{time.time_ns()}.pickle"
    rows_file.write_bytes(pickle.dumps(load_flights(limit=3 * events)))
    variants = ("events", "full-batch") if batch else ("events", "direct", "full")
    per_event: dict[str, float] = {}
    try:
        for variant in variants:
            counts = []
            for n in (events, 3 * events):
                with RedisServer() as server:
                    child = ["_flights", variant, server.url, str(n), str(rows_file)]
                    counts.append(_callgrind_instructions(server.url, n, None, child))
            per_event[variant] = (counts[1] - counts[0]) / (2 * events)
    finally:
        rows_file.unlink()
    if batch:
        return {
            "flight_construction": per_event["events"],
            "publish_many_and_step": per_event["full-batch"] - per_event["events"],
            "total_per_event": per_event["full-batch"],
        }
    flight, direct, full = per_event.values()
    return {
        "flight_construction": flight,
        "bus_publish": direct - flight,
        "step_own_waits": full - direct,
        "total_per_event": full,
    }


def _flights_consume_child(group: str, url: str, events: int) -> None:
    """Run one flights worker of `group` over the topic `_flights_child` published to, until
    its group has handled `events` flights (callgrind counts this process only)."""
    import signal

    import anyio

    from examples.flights.workers import DemoKeys, WorkerConfig, run_worker, settings_for

    settings = settings_for(url, 16)
    counters = DemoKeys(settings.key_prefix, "flights-perf").counters(group)
    read_end, _write_end = os.pipe()  # the worker stops when its stdin closes: keep it open
    os.dup2(read_end, 0)

    async def stop_when_handled() -> None:
        r = bench.aioredis.Redis.from_url(url)
        while int(await r.hget(counters, "handled") or 0) < events:  # noqa: ASYNC110 (in Redis)
            await anyio.sleep(0.5)
        await r.aclose()
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's graceful shutdown

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_handled)
            await run_worker(WorkerConfig(f"{group}-perf", group, url, "flights-perf", 16))

    anyio.run(main)


def flights_consume(events: int, profile: str | None, group: str = "both") -> dict[str, float]:
    """Instructions per handled event of one flights worker (module docstring)."""
    import pickle

    from examples.flights.flightdata import load_flights
    from examples.flights.workers import GROUPS

    rows_file = Path("/tmp") / f"perf-flights-rows-{time.time_ns()}.pickle"
    rows_file.write_bytes(pickle.dumps(load_flights(limit=3 * events)))
    result: dict[str, float] = {}
    try:
        for g in GROUPS if group == "both" else (group,):
            counts = []
            for n, keep in ((events, None), (3 * events, profile and f"{profile}.{g}")):
                with RedisServer() as server:
                    publish = [sys.executable, __file__, "_flights", "full-batch", server.url]
                    publish.append(str(n))
                    subprocess.run([*publish, str(rows_file)], check=True, env=bench.child_env())
                    child = ["_flights_consume", g, server.url, str(n)]
                    counts.append(_callgrind_instructions(server.url, n, keep, child))
            result[f"{g}_instructions_per_event"] = (counts[1] - counts[0]) / (2 * events)
    finally:
        rows_file.unlink()
    return result


def _batch_consume_child(url: str, expect: int, out: str) -> None:
    """One batch subscriber (``max_batch=500``, a no-op handler that counts, as peers.py's)
    over what the topic holds, until `expect` events are handled; writes its rate, its CPU
    share of the handled window and the time its event loop spent blocked in ``epoll_wait``
    within it (a consumer waiting for Redis: a read's reply, an XACK's) to `out`."""
    import re
    import selectors

    import anyio

    bus = bench.EventBus(bench.Settings(redis_url=url, shards=bench.SHARDS))
    state = {"n": 0, "first": 0.0, "last": 0.0, "cpu0": 0.0, "cpu1": 0.0, "wait": 0.0}
    stop = anyio.Event()

    async def handle_batch(events: list[bench.Tick]) -> None:
        if state["n"] == 0:
            state["first"], state["cpu0"] = time.perf_counter(), time.process_time()
        state["n"] += len(events)
        if state["n"] >= expect:
            state["last"], state["cpu1"] = time.perf_counter(), time.process_time()
            stop.set()

    bus.subscriber(bench.TOPIC, group="bench", batch=True, max_batch=500)(handle_batch)
    select = selectors.EpollSelector.select

    def timed_select(self: Any, timeout: float | None = None) -> Any:
        start = time.perf_counter()
        ready = select(self, timeout)
        if state["n"] and not state["last"]:
            state["wait"] += time.perf_counter() - start
        return ready

    selectors.EpollSelector.select = timed_select  # type: ignore[method-assign]
    anyio.run(lambda: bus.run(stop=stop))
    window = max(1e-9, state["last"] - state["first"])
    rss_kb = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1])  # type: ignore[index]
    Path(out).write_text(
        json.dumps(
            {
                "batch_per_s": (state["n"] - 1) / window,
                "cpu_share": (state["cpu1"] - state["cpu0"]) / window,
                "wait_ms_per_1k_events": state["wait"] / state["n"] * 1e6,
                "peak_rss_mb": rss_kb / 1024,
            }
        )
    )


def batch_redis(events: int, profile: str | None) -> dict[str, float]:
    """A batch subscriber's costs (target: a batch handler >= 0.7 x the raw read+ack): one plain
    run over N events published beforehand (rate, CPU share of the handled window, time blocked
    waiting for Redis per 1,000 events, Redis calls per 1,000 events by command, INFO
    commandstats), then callgrind runs over N / 25 and 3 N / 25 events, the difference over
    their difference: instructions per event. ``--profile F`` keeps the 3 N run's callgrind file."""
    result: dict[str, float] = {}
    with RedisServer() as server:
        out = Path("/tmp") / f"perf-batch-redis-{time.time_ns()}.json"
        cmd = [sys.executable, __file__, "_publish", server.url, str(events), str(out)]
        subprocess.run(cmd, check=True, env=bench.child_env())  # events + 1 (a warm-up)
        before = asyncio.run(bench.command_calls(server.url))
        child = [sys.executable, __file__, "_batch_consume", server.url, str(events + 1), str(out)]
        subprocess.run(child, check=True, env=bench.child_env())
        after = asyncio.run(bench.command_calls(server.url))
        result |= json.loads(out.read_text())
        out.unlink()
    for c, n in sorted(after.items()):
        if n > before.get(c, 0) and c != "info":
            result[f"calls_{c}_per_1k_events"] = (n - before.get(c, 0)) / (events + 1) * 1000
    counts = []
    small = max(1, events // 25)  # callgrind runs the child ~50 x slower
    for n, keep in ((small, None), (3 * small, profile)):
        with RedisServer() as server:
            out = Path("/tmp") / f"perf-batch-redis-{time.time_ns()}.json"
            cmd = [sys.executable, __file__, "_publish", server.url, str(n), str(out)]
            subprocess.run(cmd, check=True, env=bench.child_env())
            child = ["_batch_consume", server.url, str(n + 1), str(out)]
            counts.append(_callgrind_instructions(server.url, n, keep, child))
            out.unlink(missing_ok=True)
    result["instructions_per_event"] = (counts[1] - counts[0]) / (2 * small)
    return result


class _Open:
    """A fence that always holds (the path measured without the lease)."""

    def holds(self, d: object) -> bool:
        return True

    async def wait(self, d: object) -> bool:
        return True


def _consumer() -> tuple[Any, Any]:
    """An in-memory bus with the bench's no-op subscriber (taking a `Context`) and its
    `Consumer`, not running (the path measurements drive its parts)."""
    from eventbus import Context, EventBus, Settings
    from eventbus.consumer.running import make_consumers
    from eventbus.testing import memory_redis

    bus = EventBus(
        Settings(redis_url="redis://in-memory", shards=bench.SHARDS), redis=memory_redis()
    )

    async def handle(event: bench.Tick, ctx: Context) -> None:
        pass

    handle.__annotations__ = {"event": bench.Tick, "ctx": Context, "return": None}
    bus.subscriber(bench.TOPIC, group="bench")(handle)
    parts = bus.subscriptions, bus.redis, bus.keys, bus.settings, bus.registry
    return bus, make_consumers(*parts)[0]


def _core_consumer() -> tuple[Any, Any, list[tuple[bytes, bytes]]]:
    """`_consumer()` and 500 encoded entries of 1,000 resources (``(entry ID, data)``)."""
    from eventbus.protocol.codec import encode_entry, envelope_of

    bus, consumer = _consumer()
    entries = [
        (b"1-%d" % i, encode_entry(envelope_of(f"r{i % 1000}", bench._event(i))))
        for i in range(500)
    ]
    return bus, consumer, entries


def _hold_shard_0(consumer: Any) -> Any:
    """Shard 0 held by `consumer`, with a lease that never ends: its fence always holds."""
    from eventbus.consumer.shards import HeldShard

    held = HeldShard(0, "s", 1, 1)
    consumer.table.held[0] = held
    consumer.lease.until = float("inf")
    return held


def path(events: int, profile: str | None) -> dict[str, float]:
    import anyio

    from eventbus.client.loops import young_gc_threshold
    from eventbus.consumer.delivery import Delivery
    from eventbus.protocol.codec import encode_entry, envelope_of

    bus, consumer = _consumer()
    handling = consumer.handling
    fields = [encode_entry(envelope_of(f"r{i}", bench._event(i))) for i in range(1000)]
    fence = _Open()

    async def run() -> float:
        slot = handling.watchdog.slot()  # a worker's, as the consumer's workers have
        start = time.perf_counter()
        for i in range(0, events, 500):  # reads of 500 entries, decoded per read as consumers do
            batch = [Delivery(0, 1, b"1-%d" % j, fields[j % 1000]) for j in range(i, i + 500)]
            handling.prepare(batch)
            for d in batch:
                await handling.step(d, fence, slot)
        return (time.perf_counter() - start) / events * 1e6

    with young_gc_threshold(bus.settings.gc_threshold):  # as while consumers run
        return {"us_per_event": anyio.run(run)}


def core(events: int, profile: str | None) -> dict[str, float]:
    """The consumer's whole per-event path without Redis: read batches of 500 entries (16
    shards' worth of 1000 resources) dispatched and run by one worker as the consumer does
    (`Consumer._dispatch`, `QueueRunner.run`, acks queued), in µs per event."""
    import anyio

    from eventbus.client.loops import young_gc_threshold

    bus, consumer, entries = _core_consumer()

    async def run() -> float:
        held = _hold_shard_0(consumer)
        slot = consumer.handling.watchdog.slot()
        queues = consumer.queues
        start = time.perf_counter()
        for _ in range(events // 500):
            consumer._dispatch(held, entries, {})
            while queues._ready:
                await consumer.runner.run(queues._queues.pop(queues._ready.popleft()), slot)
            consumer.acks._batches.clear()
            consumer._report_handled()
        return (time.perf_counter() - start) / events * 1e6

    with young_gc_threshold(bus.settings.gc_threshold):  # as while consumers run
        return {"us_per_event": anyio.run(run)}


def batch_core(events: int, profile: str | None) -> dict[str, float]:
    """A batch subscription's whole path without Redis, as `core` is the per-event one's: read
    batches of 500 entries of shard 0 dispatched (`Consumer._dispatch`) and run by one of its
    workers (`BatchQueues.worker`: cut, `BatchRunner.run`: decode and validate, fence, the
    no-op ``max_batch=500`` handler, acks queued), in µs per event. No timing decides: run it
    under callgrind at N and 3 N events for instructions per event."""
    import anyio

    from eventbus import EventBus, Settings
    from eventbus.client.loops import young_gc_threshold
    from eventbus.consumer.running import make_consumers
    from eventbus.testing import memory_redis

    bus = EventBus(
        Settings(redis_url="redis://in-memory", shards=bench.SHARDS), redis=memory_redis()
    )
    handled = [0]

    async def handle_batch(events: list[bench.Tick]) -> None:
        handled[0] += len(events)

    handle_batch.__annotations__ = {"events": list[bench.Tick], "return": None}
    bus.subscriber(bench.TOPIC, group="bench", batch=True, max_batch=500)(handle_batch)
    parts = bus.subscriptions, bus.redis, bus.keys, bus.settings, bus.registry
    consumer = make_consumers(*parts)[0]
    _, _, entries = _core_consumer()

    async def run() -> float:
        held = _hold_shard_0(consumer)
        slot = consumer.handling.watchdog.slot()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer.queues.worker, consumer._work, slot, tg, anyio.Event())
            start = time.perf_counter()
            for i in range(events // 500):
                consumer._dispatch(held, entries, {})
                while handled[0] < (i + 1) * 500:
                    await anyio.lowlevel.checkpoint()
                consumer.acks._batches.clear()
                consumer._report_handled()
            elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
        return elapsed / events * 1e6

    with young_gc_threshold(bus.settings.gc_threshold):  # as while consumers run
        return {"us_per_event": anyio.run(run)}


def trickle(events: int, profile: str | None) -> dict[str, float]:
    """The consumer's path at a trickle: reads of one entry, idle workers (module docstring)."""
    import anyio
    import anyio.lowlevel

    from eventbus.client.loops import young_gc_threshold

    bus, consumer, entries = _core_consumer()

    async def run() -> float:
        held = _hold_shard_0(consumer)
        tally = consumer.tally
        async with anyio.create_task_group() as tg:
            for _ in range(consumer.settings.concurrency):
                tg.start_soon(consumer._worker, tg)
            for _ in range(3):  # every worker waits for work
                await anyio.lowlevel.checkpoint()
            start = time.perf_counter()
            for i in range(events):
                consumer._dispatch(held, [entries[i % 500]], {})
                while tally.handled <= i:  # the workers run it
                    await anyio.lowlevel.checkpoint()
                consumer.acks._batches.clear()
            took = time.perf_counter() - start
            tg.cancel_scope.cancel()
        return took / events * 1e6

    with young_gc_threshold(bus.settings.gc_threshold):  # as while consumers run
        return {"us_per_event": anyio.run(run)}


if __name__ == "__main__":
    if sys.argv[1] == "_publish":
        _publish_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    if sys.argv[1] == "_flights":
        _flights_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        sys.exit(0)
    if sys.argv[1] == "_flights_consume":
        _flights_consume_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit(0)
    if sys.argv[1] == "_batch_consume":
        _batch_consume_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    if sys.argv[1] == "_paced":
        _paced_child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = ["consume", "publish", "path", "core", "consume-redis", "publish-core"]
    verbs += ["flights-publish", "flights-consume", "trickle", "batch-redis", "batch-core"]
    parser.add_argument("what", choices=verbs)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", default=None, help="write the last run's figures here")
    parser.add_argument("--batch", action="store_true", help="flights-publish: publish_many")
    parser.add_argument("--group", default="both", help="flights-consume: a group or both")
    parser.add_argument("--rate", type=float, default=0, help="consume-redis: publish at R/s")
    args = parser.parse_args()
    fn = {
        "consume": consume,
        "publish": publish,
        "path": path,
        "core": core,
        "consume-redis": consume_redis,
        "publish-core": publish_core,
        "flights-publish": partial(flights_publish, batch=args.batch),
        "flights-consume": partial(flights_consume, group=args.group),
        "trickle": trickle,
        "batch-redis": batch_redis,
        "batch-core": batch_core,
    }[args.what]
    if args.rate:
        if args.what != "consume-redis":
            parser.error("--rate applies to consume-redis only")
        fn = functools.partial(consume_redis, rate=args.rate)
    for run in range(args.runs):
        res = fn(args.events, args.profile)
        print(json.dumps({"run": run + 1, **{k: round(v, 3) for k, v in res.items()}}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res))
