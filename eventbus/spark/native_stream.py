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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from eventbus.spark.names import canonical
from eventbus.spark.native import _text, read
from eventbus.spark.options import SourceOptions, models_option

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
        bounds = plan.collect()
        if not bounds:
            return
        # offsets keyed by topic then shard, as a batch read's startingOffsets / endingOffsets
        (start, end) = bounds[0]
        process(read(spark, batch, startingOffsets=start, endingOffsets=end), batch_id)

    return plans.writeStream.foreachBatch(each)
