"""eventbus for Spark: a topic as a DataFrame (batch and streaming), and DataFrames as events.

Built on PySpark's Python Data Source API: no Hadoop or S3A jars; objects are read through the
durable tier's obstore stores. Needs the ``spark`` extra (``pip install eventbus[spark]``).

    from eventbus.spark import register
    register(spark)
    df = spark.read.format("eventbus").option("store", "s3://bucket/eventbus") \\
        .option("topic", "orders").option("redis_url", "redis://...").load()

docs/spark.md lists the options, the schema and the consistency guarantees.

The names below are imported on first use (PEP 562): Spark's Python workers unpickle the source
and the writer by module path, and each fresh worker process would otherwise import every
module of this package (the native path's, the stream's) before its first row.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eventbus.spark.native import read
    from eventbus.spark.native_stream import read_stream
    from eventbus.spark.options import models_option
    from eventbus.spark.source import EventbusSource

__all__ = ["EventbusSource", "models_option", "read", "read_stream", "register"]

_LAZY = {
    "EventbusSource": "eventbus.spark.source",
    "models_option": "eventbus.spark.options",
    "read": "eventbus.spark.native",
    "read_stream": "eventbus.spark.native_stream",
}


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'eventbus.spark' has no attribute {name!r}")


def register(spark: Any) -> None:
    """Register format ``"eventbus"`` on `spark` (a SparkSession) and turn on Python data
    source filter pushdown (``spark.sql.python.filterPushdown.enabled``), which the batch reader
    uses to prune segments; ``option("pushdown", "false")`` reads without it."""
    from eventbus.spark.source import EventbusSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(EventbusSource)
