"""Replay a topic with Spark: the archive (and the Redis tail) as one DataFrame.

    python examples/spark_replay.py --store ./eventbus-segments --topic orders
    python examples/spark_replay.py --store s3://bucket/eventbus --topic orders \\
        --redis-url redis://127.0.0.1:6379/0 --model myapp.events:OrderPlaced
    python examples/spark_replay.py --demo        # self-contained: private Redis, 2,000 events

Prints the events per type and per shard, the first rows in entry order, the rows whose payload
did not decode, and the gap records (entries lost before they were archived). ``--demo`` starts
a private redis-server, publishes 2,000 events, archives 1,500 of them to a temporary folder and
reads archive + Redis tail. Needs ``pip install 'eventbus[spark]'`` and Java 17+.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]


class OrderPlaced(BaseModel):
    """The demo's event."""

    order_id: str
    seq: int
    total_cents: int


def spark_session() -> object:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # the workers import the demo model (examples.spark_replay:OrderPlaced)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    from pyspark.sql import SparkSession

    from eventbus.spark import register

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("eventbus-replay")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


@contextlib.contextmanager
def demo_data() -> Iterator[tuple[str, str, str]]:
    """(store, topic, redis URL): 2,000 events, 1,500 archived, 500 still in Redis only."""
    import anyio

    from eventbus import EventBus, Settings
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store
    from localredis.server import RedisServer

    async def fill(url: str, store: str) -> None:
        bus = EventBus(Settings(redis_url=url, shards=4))
        events = [
            (f"order-{i % 50}", OrderPlaced(order_id=f"order-{i % 50}", seq=i, total_cents=i * 7))
            for i in range(2000)
        ]
        try:
            async with bus:
                await bus.publish_many("orders", events[:1500])
                tier = TierSettings(hot_window_s=0, segment_max_age_s=0, segment_max_entries=200)
                await offload_until_caught_up(
                    bus.redis,
                    open_store(store),
                    topics=["orders"],
                    settings=bus.settings,
                    tier=tier,
                    timeout_s=60,
                )
                await bus.publish_many("orders", events[1500:])
        finally:
            await bus.aclose()

    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="spark-replay-") as store:
        anyio.run(fill, server.url, store)
        yield store, "orders", server.url


def replay(spark: object, store: str, topic: str, redis_url: str | None, model: str | None) -> None:
    from pyspark.sql import functions as F

    reader = spark.read.format("eventbus").option("store", store).option("topic", topic)  # type: ignore[attr-defined]
    if redis_url:
        reader = reader.option("redis_url", redis_url)
    if model:
        reader = reader.option("model", model)
    df = reader.load()
    print(f"{df.count():,} events, {df.rdd.getNumPartitions()} Spark partitions")
    df.groupBy("event_type").count().orderBy("event_type").show()
    df.groupBy("shard").agg(
        F.count(F.lit(1)).alias("events"), F.max("entry_ms").alias("last_entry_ms")
    ).orderBy("shard").show()
    first = df.orderBy("entry_ms", "shard", "entry_seq").drop("payload", "headers")
    first.show(5, truncate=40)
    bad = df.where(F.col("_corrupt").isNotNull())
    print(f"rows that did not decode: {bad.count()}")
    gaps = (
        spark.read.format("eventbus")  # type: ignore[attr-defined]
        .option("store", store)
        .option("topic", topic)
        .option("table", "gaps")
        .load()
    )
    print(f"gap records: {gaps.count()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", help="segment store URL (folder, file://, s3://)")
    parser.add_argument("--topic")
    parser.add_argument("--redis-url", help="also read the tail still in Redis")
    parser.add_argument("--model", help="pkg.module:Model for typed payload columns")
    parser.add_argument("--demo", action="store_true", help="self-contained demo data")
    args = parser.parse_args()
    if args.demo:
        with demo_data() as (store, topic, url):
            spark = spark_session()
            replay(spark, store, topic, url, "examples.spark_replay:OrderPlaced")
            spark.stop()  # type: ignore[attr-defined]
        return
    if not (args.store and args.topic):
        parser.error("--store and --topic are required (or --demo)")
    spark = spark_session()
    try:
        replay(spark, args.store, args.topic, args.redis_url, args.model)
    finally:
        spark.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
