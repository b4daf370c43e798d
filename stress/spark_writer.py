"""The Spark writer's cost per task, without Spark: `EventWriter.write` (one task, the bench's
options: model ``Flight``, ``event_id_col`` position, 16 shards) over the first N flights as
Arrow record batches of 10,000 rows (Spark's ``maxRecordsPerBatch``), against a fresh private
redis-server, next to ``bus.publish_many`` of the same rows (events built beforehand, as
``stress/spark_bench.py`` times it).

    python stress/spark_writer.py [--events 100000] [--runs 3] [--json F] [--profile F.prof]
    python stress/spark_writer.py --spark [--events 336776] [--runs 3] [--json F]
    stress/ab.sh main HEAD --what spark-writer --pairs 3 [-- --spark --events 336776]

Per run: the writer's rate (rows/s) and process CPU (µs per row), publish_many's rate, their
ratio, and the writer's Redis commands per row (``INFO commandstats``). ``--profile F`` runs the
writer under cProfile and keeps its stats in F (``python -m pstats F``); its rate is then lower.
With ``--spark`` the rows go through Spark as ``stress/spark_bench.py`` writes them: a local
SparkSession (``local[2]``, its Python workers given this ``PYTHONPATH``), the flights as a
cached DataFrame in two partitions by plane, ``df.write.format("eventbus")``; the session's
first write is ``cold_*`` (its Python workers start and import the writer, as in spark_bench's
one writer run), then ``--runs`` warm writes, each followed by ``publish_many`` of the same
rows in this process; ``ratio`` is then the median of the warm runs' ratios.
The eventbus under test is the one first on ``PYTHONPATH`` (stress/ab.py sets it per revision).
The objects loaded beforehand are frozen out of the garbage collector's passes (`gc.freeze`),
so that they do not weigh on the measured step (a Spark worker holds none of them).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import redis
from pyspark.sql.pandas.types import from_arrow_schema

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # examples/ (after the eventbus under test)

from eventbus import EventBus, Settings  # noqa: E402
from eventbus.spark.options import SourceOptions  # noqa: E402
from eventbus.spark.writer import EventWriter  # noqa: E402
from examples.flights.flightdata import FlightRow, load_flights  # noqa: E402
from localredis.server import RedisServer  # noqa: E402

MODEL = "examples.flights.flightdata:Flight"
BATCH_ROWS = 10_000


def _write(url: str, topic: str, batches: list[Any], profile: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of one task's `EventWriter.write` over `batches`."""
    opts = SourceOptions.parse(
        {
            "topic": topic,
            "redis_url": url,
            "resource_id_col": "plane",
            "model": MODEL,
            "event_id_col": "position",
            "shards": "16",
        },
        need_store=False,
    )
    writer = EventWriter(opts, from_arrow_schema(batches[0].schema))
    prof = cProfile.Profile()
    wall, cpu = time.perf_counter(), time.process_time()
    if profile:
        prof.enable()
    published = writer.write(iter(batches))
    if profile:
        prof.disable()
        prof.dump_stats(profile)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = sum(b.num_rows for b in batches)
    if published.rows != rows:
        raise SystemExit(f"the writer published {published.rows} rows of {rows}")
    return wall, cpu


async def _publish_many(url: str, topic: str, rows: list[FlightRow]) -> float:
    bus = EventBus(Settings(redis_url=url, shards=16))
    try:
        async with bus:
            events = [(r.plane, r.event()) for r in rows]
            started = time.perf_counter()
            await bus.publish_many(topic, events)
            return time.perf_counter() - started
    finally:
        await bus.aclose()


def measure(events: int, profile: str | None) -> dict[str, float]:
    rows = load_flights(None, events)
    table = pa.Table.from_pylist([r._asdict() for r in rows])
    batches = table.to_batches(max_chunksize=BATCH_ROWS)
    gc.collect()
    gc.freeze()
    with RedisServer() as server, redis.Redis.from_url(server.url) as r:
        r.config_resetstat()
        wall, cpu = _write(server.url, "writer", batches, profile)
        stats = r.info("commandstats")
        many_s = anyio.run(_publish_many, server.url, "many", rows)
    gc.unfreeze()
    out = {
        "writer_per_s": events / wall,
        "writer_cpu_us_per_row": cpu / events * 1e6,
        "publish_many_per_s": events / many_s,
        "ratio": many_s / wall,
    }
    for name, stat in stats.items():  # cmdstat_xadd -> calls_per_row_xadd
        if name not in ("cmdstat_config|resetstat", "cmdstat_ping"):
            out["calls_per_row_" + name.removeprefix("cmdstat_")] = stat["calls"] / events
    return out


def flights_frame(spark: Any, rows: list[Any]) -> Any:
    """`rows` (flights) as the writer benchmarks write them: a cached DataFrame of two
    partitions by plane, each sorted by position (each plane's order fixed), counted once so
    that the cache is filled before any write is timed. Also `spark_bench.writer_section`'s."""
    table = pa.Table.from_pylist([r._asdict() for r in rows])
    frame = (
        spark.createDataFrame(table)
        .repartition(2, "plane")
        .sortWithinPartitions("position")
        .cache()
    )
    frame.count()
    return frame


def measure_spark(events: int, runs: int) -> dict[str, float]:
    """`--spark`: the writer through a local SparkSession, cold then warm, next to
    ``publish_many`` (see the module docstring); rates in rows/s."""
    import os
    import statistics

    from pyspark.sql import SparkSession

    from eventbus.spark import register

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    path = os.environ.get("PYTHONPATH", "")  # the eventbus under test first, examples/ last
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT)) if p)
    rows = load_flights(None, events)
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    frame = flights_frame(spark, rows)
    out: dict[str, float] = {}
    ratios, rates = [], []
    with RedisServer() as server:

        def write(topic: str) -> float:
            started = time.perf_counter()
            (
                frame.write.format("eventbus")
                .option("topic", topic)
                .option("redis_url", server.url)
                .option("resource_id_col", "plane")
                .option("model", MODEL)
                .option("event_id_col", "position")
                .option("shards", "16")
                .mode("append")
                .save()
            )
            return time.perf_counter() - started

        for run in range(runs + 1):
            wall = write(f"writer-{run}")
            many_s = anyio.run(_publish_many, server.url, f"many-{run}", rows)
            if run == 0:
                out["cold_writer_per_s"] = events / wall
                out["cold_ratio"] = many_s / wall
            else:
                rates.append(events / wall)
                ratios.append(many_s / wall)
            out.setdefault("publish_many_per_s", events / many_s)
    spark.stop()
    out["writer_per_s"] = statistics.median(rates)
    out["ratio"] = statistics.median(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the last run's figures here")
    parser.add_argument("--profile", default=None, help="cProfile stats of the writer's run")
    parser.add_argument("--spark", action="store_true", help="through a local SparkSession")
    args = parser.parse_args()
    if args.spark:
        res = measure_spark(args.events, args.runs)
        print(json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res))
        return
    for run in range(args.runs):
        res = measure(args.events, args.profile)
        print(json.dumps({"run": run + 1, **{k: round(v, 3) for k, v in res.items()}}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
