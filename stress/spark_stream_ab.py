"""One side of session 7's stream / bounded A/B (docs/spark.md, "Streams' per-batch costs"):
run from a tree's root with that tree first on the path, alternating trees, e.g.::

    for i in 1 2 3; do for dir in /tmp/base /work/wt/spark; do
      (cd $dir && PYTHONPATH=$dir nice -n 10 .venv-python stress/spark_stream_ab.py); done; done

(the base tree from ``git archive base-s7 eventbus examples localredis``). The flights archive
(336,776 events, 16 shards, typed segments as `spark_bench` writes them) is built once under
``ARCHIVE`` (``--archive``) and reused by every run. Per run, one local session: the bounded
read (per shard after the entry at a quarter, up to the one at three quarters) alternated
with the whole native read, ``typed_native``'s aggregate, 11 rounds, the last 8 kept
(medians); then `eventbus.spark.read_stream` ``Trigger.AvailableNow`` runs of the whole
archive, each micro-batch running the same aggregate, one warm-up and 3 timed runs (median)
without a limit and with ``maxOffsetsPerTrigger=100000``. Prints ``RESULT <json>``.
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

N = 336_776


def archive(store: str) -> str:
    """`store`, with topic ``bench-a`` (the first `N` flights, typed segments as `spark_bench`
    writes them) archived in it first when it is not there yet."""
    if not Path(store, "bench-a").exists():
        import anyio
        import spark_bench as sb

        from examples.flights.flightdata import load_flights

        with sb.redis_url() as url:
            import redis

            redis.Redis.from_url(url).flushdb()
            anyio.run(sb.publish_and_archive, url, "bench-a", load_flights(None, N), store)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archive", default="/tmp/s7spark/store")
    store = archive(parser.parse_args().archive)

    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    import eventbus
    from eventbus.spark import read, read_stream
    from eventbus.tier.layout import parse_segment_key
    from examples.flights.spark_step import start_spark

    assert eventbus.__file__.startswith(os.getcwd()), eventbus.__file__  # the tree measured
    spark = start_spark()
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    starts: dict[str, str] = {}
    ends: dict[str, str] = {}
    for f in sorted(str(p) for p in Path(store).rglob("*.parquet")):
        ref = parse_segment_key(f)
        assert ref is not None
        ids = pq.read_table(f, columns=["entry_id"]).column(0).to_pylist()
        starts[str(ref.shard)], ends[str(ref.shard)] = ids[len(ids) // 4], ids[3 * len(ids) // 4]
    opts = {"store": store, "topic": "bench-a", "model": "examples.flights.flightdata:Flight"}
    bounded = {
        **opts,
        "startingOffsets": json.dumps({"bench-a": starts}),
        "endingOffsets": json.dumps({"bench-a": ends}),
    }

    def agg(df: Any) -> int:
        return int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0])

    times: dict[str, list[float]] = {"bounded": [], "whole": []}
    rows = {"bounded": 0, "whole": N}
    for r in range(11):
        order = [("bounded", bounded), ("whole", opts)]
        for name, o in order if r % 2 else order[::-1]:
            t = time.perf_counter()
            rows[name] = agg(read(spark, o))
            if r >= 3:
                times[name].append(time.perf_counter() - t)
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["bounded_rows"] = rows["bounded"]
    out["bounded_ratio"] = round((rows["bounded"] / out["bounded"]) / (N / out["whole"]), 3)

    def stream(limit: int | None) -> float:
        seen: list[int] = []

        def save(df: Any, batch_id: int) -> None:
            seen.append(agg(df))

        o = {**opts, **({"maxOffsetsPerTrigger": limit} if limit else {})}
        with tempfile.TemporaryDirectory() as ckpt:
            t = time.perf_counter()
            q = (
                read_stream(spark, save, o)
                .option("checkpointLocation", ckpt)
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
            took = time.perf_counter() - t
        assert sum(seen) == N, seen
        return took

    for name, limit in (("stream", None), ("stream_100k", 100_000)):
        stream(limit)
        out[name] = round(statistics.median([stream(limit) for _ in range(3)]), 3)
    out["stream_ratio"] = round(out["whole"] / out["stream"], 3)
    out["stream_100k_rate"] = round(N / out["stream_100k"])
    out["load"] = os.getloadavg()[0]
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
