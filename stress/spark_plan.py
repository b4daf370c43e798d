"""Where the native path's planning time goes (docs/spark.md, "Where the 1M/s target stands"):
the Py4J commands of `eventbus.spark.jvm.parquet_select`, each timed, then the typed aggregate's
job, round after round in one SparkSession (a command right after a job waits for Spark to
finish the last one's bookkeeping, as in a real read); medians in milliseconds, first rounds
untimed.

    STORE=/tmp/archive python stress/spark_plan.py 16

The store must hold topic ``bench-a`` archived with typed columns for the flights model, as
``stress/spark_ab.py`` needs. Prints one JSON object: per step the median milliseconds, and
every round's.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.flights.spark_step import start_spark  # noqa: E402

MODEL = "examples.flights.flightdata:Flight"
UNTIMED = 4


def main() -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.classic.dataframe import DataFrame

    from eventbus.spark import native
    from eventbus.spark.jvm import _Tools
    from eventbus.spark.options import SourceOptions, models_option

    rounds, store = int(sys.argv[1]), os.environ["STORE"]
    spark = start_spark()
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    opts = SourceOptions.parse({"store": store, "topic": "bench-a", "model": models_option(MODEL)})
    given, exprs = native._columns(tuple(opts.models().items()))
    files = sorted(glob.glob(f"{store}/bench-a/*/*.parquet"))
    paths = [f"{native._root(store)}/{Path(f).relative_to(store)}" for f in files]
    plain_schema = spark.read.parquet(*paths).schema
    jsession = spark._jsparkSession
    tools = _Tools(spark, jsession)
    steps: dict[str, list[float]] = {}

    def timed(name: str, started: float) -> None:
        steps.setdefault(name, []).append((time.perf_counter() - started) * 1000)

    for _ in range(rounds + UNTIMED):
        t = time.perf_counter()
        schema = jsession.parseDataType(given.json())
        timed("parse_schema", t)
        t = time.perf_counter()
        reader = jsession.read().schema(schema)
        timed("reader", t)
        t = time.perf_counter()
        seq = tools.seq(json.dumps(paths))
        timed("paths_seq", t)
        t = time.perf_counter()
        relation = reader.parquet(seq)
        timed("relation", t)
        t = time.perf_counter()
        seq = tools.seq(json.dumps(list(exprs)))
        timed("exprs_seq", t)
        t = time.perf_counter()
        df = DataFrame(relation.selectExpr(seq), spark)
        timed("projection", t)
        t = time.perf_counter()
        df.agg(F.count("*"), F.sum("dep_delay")).first()
        timed("job", t)
        t = time.perf_counter()
        plain = spark.read.schema(plain_schema).parquet(*paths)
        timed("plain_relation", t)
        t = time.perf_counter()
        plain.agg(F.count("*"), F.sum("dep_delay")).first()
        timed("plain_job", t)
    out: dict[str, Any] = {
        "rounds": rounds,
        "median_ms": {k: round(statistics.median(v[UNTIMED:]), 2) for k, v in steps.items()},
        "rounds_ms": {k: [round(x, 2) for x in v[UNTIMED:]] for k, v in steps.items()},
    }
    print(json.dumps(out, indent=1))
    spark.stop()


if __name__ == "__main__":
    main()
