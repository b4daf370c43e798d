"""A stream whose micro-batches are read by the native path: `read_stream`.

``spark.readStream.format("eventbus")`` reads every micro-batch through the Python source: its
rows cross from Python workers to the JVM (about a tenth of Spark's own Parquet reader's rate,
docs/spark.md). PySpark's streaming data source API has no way to hand Spark a Parquet scan for
a micro-batch, so `read_stream` splits the work: the eventbus stream plans the micro-batches (its
offsets, checkpoint, ``maxOffsetsPerTrigger``, ``failOnDataLoss`` and ``Trigger.AvailableNow``
exactly as ``format("eventbus")``'s, option ``_plan``: one row per micro-batch with its start and
end offsets instead of the entries), and ``foreachBatch`` reads each micro-batch's entries with
`eventbus.spark.read` bounded by those offsets (``startingOffsets`` / ``endingOffsets``): the
archived part a Parquet scan of the segments it covers, the Redis part from the Python source,
unioned; the rows of (start, end] per shard, as the Python stream gives them.

A micro-batch's bounds are taken from its planned partition in the JVM (`batch_bounds`: the
pickled `PlanPart` the stream's planner returned), not by running a Spark job that reads the
plan row in a Python worker (a job per micro-batch, about a third of a small batch's time).
That uses internals of Spark's micro-batch plan; when a Spark upgrade has moved them, the
plan row is read by ``collect()`` as before and logger ``eventbus.spark`` says so once per
process.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from eventbus.spark.names import canonical
from eventbus.spark.native import _text, read
from eventbus.spark.options import SourceOptions, models_option
from eventbus.spark.stream import PlanPart

log = logging.getLogger("eventbus.spark")
_SAID: list[str] = []  # the internal found missing, once said in this process

# stream options the bounded batch read of a micro-batch does not take (the offsets replace them)
_STREAM_ONLY = ("startingoffsets", "startingtimestamp", "maxoffsetspertrigger")


def read_stream(
    spark: Any,
    process: Callable[[Any, int], None],
    options: Mapping[str, Any] | None = None,
    **more: Any,
) -> Any:
    """A ``DataStreamWriter`` of the topic (``topic`` or ``subscribe``) whose ``foreachBatch``
    calls ``process(df, batch_id)`` with each micro-batch's rows read natively (see the module
    docstring): ``df`` has ``format("eventbus")``'s schema and rows. Options as
    `eventbus.spark.read`'s plus the stream's (``startingOffsets``, ``startingTimestamp``,
    ``maxOffsetsPerTrigger``, ``failOnDataLoss``); give the query its checkpoint and trigger::

        q = read_stream(spark, save, store=url, topic="orders", model=Order) \\
            .option("checkpointLocation", ckpt).trigger(availableNow=True).start()

    A micro-batch with no new entry does not call `process`. Raises `ConfigError` for a bad
    option (the stream's own errors come from ``start()`` and the query, as
    ``readStream.format("eventbus")``'s)."""
    given = {**(options or {}), **more}
    strings = {k: models_option(v) if k == "model" else _text(v) for k, v in given.items()}
    SourceOptions.parse(strings)  # bad options fail here, not in the query
    batch = {k: v for k, v in strings.items() if not set(canonical({k: v})) & set(_STREAM_ONLY)}
    plans = spark.readStream.format("eventbus").options(**strings, _plan="true").load()

    def each(plan: Any, batch_id: int) -> None:
        bounds = batch_bounds(plan)
        if bounds is None:
            return
        # offsets keyed by topic then shard, as a batch read's startingOffsets / endingOffsets
        start, end = bounds
        process(read(spark, batch, startingOffsets=start, endingOffsets=end), batch_id)

    return plans.writeStream.foreachBatch(each)


def batch_bounds(plan: Any) -> tuple[str, str] | None:
    """The start and end offsets (`Offsets` as JSON) of the ``_plan`` micro-batch `plan` (the
    DataFrame ``foreachBatch`` gets), None for a batch without entries. Read from its planned
    partition in the JVM (`_planned`), else from its row (a Spark job)."""
    try:
        if type(plan).__module__.startswith("pyspark.sql.connect"):
            raise _OtherPlan  # no JVM in this process: the row is the route, said by no one
        return _planned(plan)
    except _OtherPlan:
        pass
    except Exception as exc:  # an internal moved (py4j, attribute or pickle errors): the row
        if not _SAID:
            _SAID.append(type(exc).__name__)
            log.warning(
                "eventbus.spark.read_stream reads each micro-batch's bounds with a Spark job: "
                "its planned partition is out of reach (%s)",
                _first_line(exc),
            )
    rows = plan.collect()
    return (rows[0][0], rows[0][1]) if rows else None


class _OtherPlan(Exception):
    """The micro-batch's RDD is not a planned `PlanPart`'s (or is out of this process: Spark
    Connect): its row is read instead."""


def _planned(plan: Any) -> tuple[str, str] | None:
    """`plan`'s `PlanPart` offsets from the JVM without a job: ``foreachBatch``'s DataFrame is
    a ``LogicalRDD`` over the micro-batch's RDD, whose first ancestor is Spark's
    ``DataSourceRDD`` of the stream's planned partitions (pickled `PlanPart`s, one or none).
    Raises `_OtherPlan` for another plan (e.g. Spark's empty RDD of a batch without
    partitions), and what a moved internal raises."""
    rdd = plan._jdf.queryExecution().logical().rdd()
    while not rdd.dependencies().isEmpty():
        rdd = rdd.dependencies().head().rdd()
    if not rdd.getClass().getName().endswith(".DataSourceRDD"):
        raise _OtherPlan
    parts = rdd.partitions()
    if len(parts) == 0:
        return None
    if len(parts) != 1:
        raise _OtherPlan
    part = pickle.loads(bytes(parts[0].inputPartition().get().pickedPartition()))
    if not isinstance(part, PlanPart):
        raise TypeError(f"a micro-batch's planned partition is a {type(part).__name__}")
    return part.start, part.end


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
