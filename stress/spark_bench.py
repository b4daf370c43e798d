"""Spark benchmark: the eventbus source against pyarrow on the same segments, the writer against
``publish_many``.

    python stress/spark_bench.py                    # the first 200,000 NYC flights of 2013
    python stress/spark_bench.py --events 336776    # the whole year
    python stress/spark_bench.py --out stress/results/spark_bench.json

Starts a private redis-server (or uses REDIS_URL, whose database it FLUSHES), publishes the
flights with ``bus.publish_many`` (timed: the writer's reference), archives them with the
offloader to a temporary folder, starts a local SparkSession (``local[2]``), then measures, each
run twice and the faster kept (Spark is warm by then):

* ``pyarrow``: ``pq.read_table`` of every segment file, in this process, one thread: the ceiling
  of reading these files at all;
* ``pyarrow_in_spark``: the same reads inside Spark tasks (``mapInArrow`` over the file list,
  one task per file), batches handed to the JVM: the ceiling of any Python source in Spark;
* ``raw``: ``spark.read.format("eventbus")`` (verified segments, Arrow batches), ``count()``;
* ``typed``: the same with ``model=Flight`` (payloads decoded and validated by pydantic), and
  ``typed_arrow`` with ``validate=false`` (payload maps converted by Arrow);
* ``typed_agg`` / ``typed_native``: a typed aggregate (``count(*)``, ``sum(dep_delay)``) through
  the Python source and through `eventbus.spark.read`'s native path (Spark's Parquet reader on
  the typed segment columns), same cut; ``duckdb_typed``: the same aggregate in DuckDB with one
  ``read_parquet`` of the archive;
* ``offload_us_per_event``: `encode_segment` of 50,000 of the entries, raw and with typed columns;
* ``writer``: ``df.write.format("eventbus")`` of the same flights to another topic.

All rates are events/s. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eventbus import EventBus, Settings  # noqa: E402
from eventbus.testing.server import RedisServer  # noqa: E402
from examples.flights.flightdata import load_flights  # noqa: E402

MODEL = "examples.flights.flightdata:Flight"


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    with RedisServer() as server:
        yield server.url


def best(fn: Callable[[], int], n: int, runs: int = 2) -> dict[str, Any]:
    """Run `fn` (which returns the rows it saw) `runs` times; the faster run's rate."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        rows = fn()
        times.append(time.perf_counter() - started)
        if rows != n:
            raise SystemExit(f"expected {n} rows, got {rows}")
    return {"seconds": round(min(times), 3), "events_per_s": round(n / min(times), 1)}


async def publish_and_archive(url: str, topic: str, rows: list[Any], store: str) -> float:
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    bus = EventBus(Settings(redis_url=url, shards=16))
    try:
        async with bus:
            events = [(r.plane, r.event()) for r in rows]
            started = time.perf_counter()
            await bus.publish_many(topic, events)
            publish_s = time.perf_counter() - started
            tier = TierSettings(
                hot_window_s=0,
                segment_max_age_s=0,
                trim_exact=True,
                typed_models={topic: MODEL},  # typed segments: the native path reads them
            )
            await offload_until_caught_up(
                bus.redis,
                open_store(store),
                topics=[topic],
                settings=bus.settings,
                tier=tier,
                timeout_s=900,
            )
    finally:
        await bus.aclose()
    return publish_s


def offload_cost(topic: str, n: int) -> dict[str, float]:
    """`encode_segment` (the offloader's CPU per segment) of `n` flights as published:
    microseconds per event, raw and with typed columns (best of 2)."""
    from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
    from eventbus.protocol.ids import EntryId
    from eventbus.tier.segment import encode_segment
    from eventbus.tier.typed import TypedPayloads, load_models

    entries = []
    for i, f in enumerate(load_flights(None, n)):
        payload = f.event().model_dump(mode="json")
        env = Envelope(f.plane, "flights.Flight", new_event_id(), 1, {}, payload)
        entries.append((EntryId(1 + i, 0), encode_entry(env)))
    typed = TypedPayloads(load_models(MODEL) or {})
    out = {}
    for name, t in (("raw", None), ("typed", typed)):
        times = []
        for _ in range(2):
            started = time.perf_counter()
            encode_segment(topic, 0, entries[0][0], entries[-1][0], entries, typed=t)
            times.append(time.perf_counter() - started)
        out[name] = round(min(times) / n * 1e6, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    rows = load_flights(None, args.events)
    n = len(rows)
    result: dict[str, Any] = {
        "events": n,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    with redis_url() as url, tempfile.TemporaryDirectory(prefix="spark-bench-") as store:
        import redis

        redis.Redis.from_url(url).flushdb()
        publish_s = anyio.run(publish_and_archive, url, "bench-a", rows, store)
        result["publish_many"] = {"events_per_s": round(n / publish_s, 1)}
        files = sorted(str(p) for p in Path(store).rglob("*.parquet"))
        result["segments"] = len(files)
        result["segment_bytes"] = sum(Path(f).stat().st_size for f in files)

        import pyarrow.parquet as pq

        pq.read_table(files[0])  # warm-up (imports)
        result["pyarrow"] = best(lambda: sum(pq.read_table(f).num_rows for f in files), n)

        started = time.perf_counter()
        from examples.flights.spark_step import start_spark

        spark = start_spark()
        result["spark_startup_s"] = round(time.perf_counter() - started, 1)

        def arrow_in_spark() -> int:
            from pyspark.sql.pandas.types import from_arrow_schema

            def read(batches: Any) -> Any:
                import pyarrow.parquet as pq

                for b in batches:
                    for path in b.column(0).to_pylist():
                        # the topic column is a dictionary, which Spark does not take as is
                        yield from pq.read_table(path).drop_columns(["topic"]).to_batches()

            schema = from_arrow_schema(pq.read_schema(files[0]).remove(0))
            paths = spark.createDataFrame([(f,) for f in files], "path string")
            return paths.repartition(len(files)).mapInArrow(read, schema).count()

        result["pyarrow_in_spark"] = best(arrow_in_spark, n)

        def source(**options: str) -> Callable[[], int]:
            def run() -> int:
                r = spark.read.format("eventbus").option("store", store).option("topic", "bench-a")
                for k, v in options.items():
                    r = r.option(k, v)
                return r.load().count()

            return run

        from pyspark.sql import functions as F

        from eventbus.spark import read

        def typed_agg(df: Any) -> int:
            return int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0])

        opts = {"store": store, "topic": "bench-a", "model": MODEL}
        python_df = spark.read.format("eventbus").options(**opts)
        result["typed_agg"] = best(lambda: typed_agg(python_df.load()), n)
        result["typed_native"] = best(lambda: typed_agg(read(spark, opts)), n)
        result["typed_native"]["vs_typed_python"] = round(
            result["typed_native"]["events_per_s"] / result["typed_agg"]["events_per_s"], 2
        )
        import duckdb

        glob = f"{store}/bench-a/*/*.parquet"
        query = f"SELECT count(*), sum(dep_delay) FROM read_parquet('{glob}', union_by_name=1)"
        result["duckdb_typed"] = best(lambda: int(duckdb.sql(query).fetchall()[0][0]), n)
        result["offload_us_per_event"] = offload_cost("bench-a", min(n, 50_000))

        result["raw"] = best(source(), n)
        result["typed"] = best(source(model=MODEL), n)
        result["typed_arrow"] = best(source(model=MODEL, validate="false"), n)
        for name in ("raw", "typed", "typed_arrow"):
            result[name]["vs_pyarrow"] = round(
                result[name]["events_per_s"] / result["pyarrow"]["events_per_s"], 3
            )
            result[name]["vs_pyarrow_in_spark"] = round(
                result[name]["events_per_s"] / result["pyarrow_in_spark"]["events_per_s"], 3
            )

        import pyarrow as pa

        table = pa.Table.from_pylist([r._asdict() for r in rows])
        frame = (
            spark.createDataFrame(table)
            .repartition(2, "plane")
            .sortWithinPartitions("position")
            .cache()
        )
        frame.count()

        def write() -> int:
            (
                frame.write.format("eventbus")
                .option("topic", "bench-b")
                .option("redis_url", url)
                .option("resource_id_col", "plane")
                .option("model", MODEL)
                .option("event_id_col", "position")
                .option("shards", "16")
                .mode("append")
                .save()
            )
            return n

        result["writer"] = best(write, n, runs=1)
        result["writer"]["vs_publish_many"] = round(
            result["writer"]["events_per_s"] / result["publish_many"]["events_per_s"], 3
        )
        result["targets"] = {
            "raw_at_least_half_pyarrow_in_spark": result["raw"]["vs_pyarrow_in_spark"] >= 0.5,
            "typed_at_least_200k": result["typed"]["events_per_s"] >= 200_000,
        }
        spark.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
