"""eventbus for Spark: a topic as a DataFrame (batch and streaming), and DataFrames as events.

Built on PySpark's Python Data Source API: no Hadoop or S3A jars; objects are read through the
durable tier's obstore stores. Needs the ``spark`` extra (``pip install eventbus[spark]``).

    from eventbus.spark import register
    register(spark)
    df = spark.read.format("eventbus").option("store", "s3://bucket/eventbus") \\
        .option("topic", "orders").option("redis_url", "redis://...").load()

docs/spark.md lists the options, the schema and the consistency guarantees.
"""

from __future__ import annotations

from typing import Any

from eventbus.spark.native import read
from eventbus.spark.options import models_option
from eventbus.spark.source import EventbusSource

__all__ = ["EventbusSource", "models_option", "read", "register"]


def register(spark: Any) -> None:
    """Register format ``"eventbus"`` on `spark` (a SparkSession) and turn on Python data
    source filter pushdown (``spark.sql.python.filterPushdown.enabled``), which the batch reader
    uses to prune segments; ``option("pushdown", "false")`` reads without it."""
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(EventbusSource)
