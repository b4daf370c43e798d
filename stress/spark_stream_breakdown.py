"""Where a native stream's (`eventbus.spark.read_stream`) time goes, per phase: run from a
tree's root (that tree is measured)::

    nice -n 10 .venv/bin/python stress/spark_stream_breakdown.py [--archive DIR] [--runs 3]

On the flights archive of `stress/spark_stream_ab.py` (built there once), one local session:
the whole typed native read (``typed_native``'s aggregate, median of 5 after 2 warm-ups), then
``Trigger.AvailableNow`` streams of the whole archive, without a limit and with
``maxOffsetsPerTrigger=100000`` (one warm-up and ``--runs`` timed runs each). Per run it
reports Spark's own phases from the query's progress (``durationMs``: ``latestOffset``,
``queryPlanning``, ``walCommit``, ``addBatch``, ``triggerExecution``, summed over the
micro-batches), and, inside ``addBatch`` (the ``foreachBatch`` function), the driver's time in
`batch_bounds`, in `eventbus.spark.read` (building the micro-batch's DataFrame: planning the
cut, footers, the JVM relation) and in the aggregate's job; ``start_to_first_batch`` is the
time from ``start()`` to the first ``foreachBatch`` call (the stream planner's Python process
started and the first offsets planned). Prints one line per run and ``RESULT <json>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))

from spark_stream_ab import N, archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archive", default="/tmp/s7spark/store")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    store = archive(args.archive)

    from pyspark.sql import functions as F

    import eventbus
    from eventbus.spark import native_stream, read
    from examples.flights.spark_step import start_spark

    assert eventbus.__file__.startswith(os.getcwd()), eventbus.__file__  # the tree measured
    spark = start_spark()
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    opts = {"store": store, "topic": "bench-a", "model": "examples.flights.flightdata:Flight"}

    def agg(df: Any) -> int:
        return int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0])

    whole = []
    for i in range(7):
        t = time.perf_counter()
        assert agg(read(spark, opts)) == N
        if i >= 2:
            whole.append(time.perf_counter() - t)
    out: dict[str, Any] = {"typed_native_s": round(statistics.median(whole), 3)}

    spent: dict[str, float] = {}
    marks: list[float] = []

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    native_stream.batch_bounds = timed("bounds", native_stream.batch_bounds)
    native_stream.read = timed("read_plan", native_stream.read)

    def stream(limit: int | None) -> dict[str, float]:
        spent.clear()
        marks.clear()
        seen: list[int] = []

        def save(df: Any, batch_id: int) -> None:
            marks.append(time.perf_counter())
            t = time.perf_counter()
            seen.append(agg(df))
            spent["job"] = spent.get("job", 0.0) + time.perf_counter() - t

        o = {**opts, **({"maxOffsetsPerTrigger": limit} if limit else {})}
        with tempfile.TemporaryDirectory() as ckpt:
            t = time.perf_counter()
            q = (
                native_stream.read_stream(spark, save, o)
                .option("checkpointLocation", ckpt)
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
            took = time.perf_counter() - t
            progress = q.recentProgress
        assert sum(seen) == N, seen
        row: dict[str, float] = {"total": took, "batches": len(seen)}
        row["start_to_first_batch"] = marks[0] - t if marks else 0.0
        for p in progress:
            for k, v in (p.durationMs or {}).items():
                row[f"spark_{k}"] = row.get(f"spark_{k}", 0.0) + v / 1000
        row |= spent
        return {k: round(v, 3) for k, v in row.items()}

    for name, limit in (("stream", None), ("stream_100k", 100_000)):
        stream(limit)  # warm-up
        runs = [stream(limit) for _ in range(args.runs)]
        for r in runs:
            print(name, json.dumps(r), flush=True)
        out[name] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        out[name]["ratio_typed_native"] = round(out["typed_native_s"] / out[name]["total"], 3)
    out["stream_100k"]["rows_per_s"] = round(N / out["stream_100k"]["total"])
    out["load"] = os.getloadavg()
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
