"""The Spark step of the flights demo (DESIGN §8): a Spark job over the run's topic.

After the durable-tier step, a local SparkSession reads the topic with ``format("eventbus")``:
the archived segments plus the tail still in Redis (``redis_url``), one consistent cut, payloads
decoded into the `Flight` model's columns. It computes per carrier the flights and the mean
departure delay (they must equal the CSV's), and checks that each plane's sequence numbers
strictly increase when its rows are ordered by entry ID (a plane lives on one shard, whose entry
IDs are its publish order) and that every published flight is there once.

With ``--spark-publish`` the same session publishes the CSV rows instead of the Python publisher:
``df.write.format("eventbus")`` with the rows partitioned by plane and sorted by position, so
each plane's flights are published in order.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from examples.flights.flightdata import CarrierStats, FlightRow, aggregates_match

MODEL = "examples.flights.flightdata:Flight"
ROOT = Path(__file__).resolve().parents[2]


def start_spark() -> Any:
    """A local SparkSession (2 cores, UI off) with the eventbus source registered. Its Python
    workers run this interpreter and import the demo from the project root. About 15 s."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    from pyspark.sql import SparkSession

    from eventbus.spark import register

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("eventbus-flights")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def spark_publish(
    spark: Any, rows: list[FlightRow], topic: str, redis_url: str, shards: int
) -> int:
    """Publish `rows` through the eventbus writer (event IDs derived from ``position``, each
    plane's flights in order). Returns the rows published."""
    import pyarrow as pa

    table = pa.Table.from_pylist([r._asdict() for r in rows])
    df = spark.createDataFrame(table).repartition(4, "plane").sortWithinPartitions("position")
    (
        df.write.format("eventbus")
        .option("topic", topic)
        .option("redis_url", redis_url)
        .option("resource_id_col", "plane")
        .option("model", MODEL)
        .option("event_id_col", "position")
        .option("shards", str(shards))
        .mode("append")
        .save()
    )
    return len(rows)


def spark_check(
    spark: Any,
    topic: str,
    store_url: str,
    redis_url: str,
    published: int,
    reference: dict[str, CarrierStats],
) -> dict[str, Any]:
    """Read the topic (segments + Redis tail) and check it; returns the summary's Spark keys:
    ``spark_rows``, ``spark_events_per_s`` (planning the read and the aggregation job, Spark's
    start-up apart),
    ``spark_aggregates_match``, ``spark_order_ok``, ``spark_read_path``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from eventbus.spark import read

    # the native path: typed segments through Spark's Parquet reader, the Redis tail through the
    # eventbus source; a payload that does not validate is counted in _corrupt (checked below)
    started = time.perf_counter()
    df = read(spark, store=store_url, topic=topic, redis_url=redis_url, model=MODEL)
    per_carrier = (
        df.groupBy("carrier")
        .agg(
            F.count(F.lit(1)).alias("flights"),
            F.sum("dep_delay").alias("delay_sum"),
            F.count("dep_delay").alias("delay_n"),
        )
        .collect()
    )
    agg_s = max(1e-9, time.perf_counter() - started)
    got = {
        r.carrier: CarrierStats(r.flights, int(r.delay_sum or 0), r.delay_n) for r in per_carrier
    }
    rows = sum(s.flights for s in got.values())
    by_entry = Window.partitionBy("plane").orderBy("entry_ms", "entry_seq")
    checked = (
        df.select("plane", "seq", "position", "entry_ms", "entry_seq", "_corrupt")
        .withColumn("prev", F.lag("seq").over(by_entry))
        .agg(
            F.sum(F.when(F.col("seq") <= F.col("prev"), 1).otherwise(0)).alias("violations"),
            F.countDistinct("position").alias("positions"),
            F.count(F.lit(1)).alias("rows"),
            F.count("_corrupt").alias("corrupt"),
        )
        .collect()[0]
    )
    order_ok = (
        (checked.violations or 0) == 0
        and checked.positions == checked.rows == published
        and checked.corrupt == 0
    )
    return {
        "spark_rows": rows,
        "spark_events_per_s": round(rows / agg_s, 1),
        "spark_aggregates_match": aggregates_match(got, reference),
        "spark_order_ok": bool(order_ok),
        # "native" when the segments were read by Spark's Parquet reader (eventbus.spark.read)
        "spark_read_path": "native" if df.inputFiles() else "python",
    }


async def publish_step(run: Any) -> None:
    """``--spark-publish``: publish `run.rows` with the Spark writer instead of the Python
    publisher; sets `run.published` and the publish times (session start-up not included)."""
    import anyio

    spark = await anyio.to_thread.run_sync(start_spark)
    run.publish_start_ms = time.time() * 1000
    run.published = await anyio.to_thread.run_sync(
        spark_publish, spark, run.rows, run.topic, run.settings.redis_url, run.settings.shards
    )
    run.publish_end_ms = time.time() * 1000


async def check_step(run: Any, store_url: str) -> dict[str, Any]:
    """The final Spark step (`spark_check`) in a worker thread; stops the session after."""
    import anyio

    def job() -> dict[str, Any]:
        started = time.perf_counter()
        spark = start_spark()
        startup_s = time.perf_counter() - started
        try:
            out = spark_check(
                spark, run.topic, store_url, run.settings.redis_url, run.published, run.reference
            )
            return {**out, "spark_startup_s": round(startup_s, 1)}
        finally:
            spark.stop()

    return await anyio.to_thread.run_sync(job)
