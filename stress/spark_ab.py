"""A/B of Spark settings on the typed aggregate of an archive (docs/spark.md, "The native path's
cost at small sizes"): every variant in one SparkSession, alternated round by round, two untimed
rounds first; per variant the median wall seconds (of which building the DataFrame) and CPU
seconds (the JVM process and this Python process, from /proc: less moved by a busy machine).

    STORE=/tmp/archive python stress/spark_ab.py 6 \\
        '{"native": ["native", {}], "main": ["native@main", {}], "plain": ["plain", {}],
          "one_task": ["native", {"spark.sql.files.minPartitionNum": "1"}]}'

The store must hold topic ``bench-a`` archived with typed columns for the flights model
(``stress/spark_bench.py`` writes one in its temporary folder); ``native`` is
`eventbus.spark.read`, ``native@REV`` the same function of ``eventbus/spark/native.py`` as of
git revision ``REV`` (the rest of the package as checked out: before / after a change in one
session), ``plain`` ``spark.read.schema(s).parquet(files)``. Each variant's settings
are set before its run and reset after; adaptive query execution is off for all.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.flights.spark_step import start_spark  # noqa: E402

MODEL = "examples.flights.flightdata:Flight"


def native_at(rev: str) -> Any:
    """``eventbus/spark/native.py`` as of git revision `rev`, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:eventbus/spark/native.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(f"native_at_{rev}")
    module.__file__ = f"{rev}:eventbus/spark/native.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def main() -> None:
    from pyspark.sql import functions as F

    from eventbus.spark import read

    rounds, variants = int(sys.argv[1]), json.loads(sys.argv[2])
    store = os.environ["STORE"]
    files = sorted(f"file://{Path(f).resolve()}" for f in glob.glob(f"{store}/bench-a/*/*.parquet"))
    spark = start_spark()
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / tick + time.process_time()

    opts = {"store": store, "topic": "bench-a", "model": MODEL}
    schema = spark.read.parquet(*files).schema
    build = {
        "native": lambda: read(spark, opts),
        "plain": lambda: spark.read.schema(schema).parquet(*files),
    }
    for path, _ in variants.values():
        if path.startswith("native@"):
            other = native_at(path.split("@", 1)[1])
            build[path] = lambda other=other: other.read(spark, opts)
    keys = {k for _, conf in variants.values() for k in conf}
    base = {k: spark.conf.get(k, None) for k in keys}
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    expected = None
    for r in range(rounds + 2):
        for name, (path, conf) in variants.items():
            for k, v in conf.items():
                spark.conf.set(k, v)
            c, w = cpu(), time.perf_counter()
            df = build[path]()
            planned = time.perf_counter() - w
            rows = int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0])
            took, used = time.perf_counter() - w, cpu() - c
            for k in conf:
                if base[k] is None:
                    spark.conf.unset(k)
                else:
                    spark.conf.set(k, base[k])
            if expected is None:
                expected = rows
            if rows != expected:
                raise SystemExit(f"{name}: {rows} rows, expected {expected}")
            if r >= 2:
                runs[name].append((took, planned, used))
    for name, got in runs.items():
        wall, plan, used = (statistics.median(x[i] for x in got) for i in range(3))
        rate = (expected or 0) / wall
        print(f"{name:22s} wall {wall:.3f} s (plan {plan:.3f})  cpu {used:.3f} s  {rate:,.0f}/s")
    spark.stop()


if __name__ == "__main__":
    main()
