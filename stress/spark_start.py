"""What a Python process Spark starts for the eventbus source costs before it plans: the
imports of PySpark's stream runner (done before the process connects back to the JVM, which
Spark bounds at 10 s) and then eventbus's (done after: the source unpickled, a typed stream
reader made, as the stream planner does before planning). Alternates trees and bytecode-cache
settings, a fresh interpreter per sample::

    nice -n 10 .venv/bin/python stress/spark_start.py --tree /tmp/base --tree . --runs 5
    nice -n 10 .venv/bin/python stress/spark_start.py --tree . --pycache /tmp/pyc --runs 5

``--pycache DIR`` adds a variant with ``PYTHONPYCACHEPREFIX=DIR`` (fill it first: run once
without ``PYTHONDONTWRITEBYTECODE``). Prints one line per sample and ``RESULT <json>``
(medians: wall and CPU seconds of each step, modules eventbus added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0, c0 = time.perf_counter(), cpu()
import pyspark.sql.streaming.python_streaming_source_runner
t1, c1 = time.perf_counter(), cpu()
before = set(sys.modules)
import eventbus.spark.stream
from eventbus.spark.schema import read_schema
from eventbus.spark.source import EventbusSource
options = {"store": "/tmp", "topic": "t", "model": "examples.flights.flightdata:Flight"}
EventbusSource(options).streamReader(read_schema(None))  # what the planner does first
t2, c2 = time.perf_counter(), cpu()
assert eventbus.spark.source.__file__.startswith(sys.argv[1]), eventbus.spark.source.__file__
print(json.dumps({"runner_wall": t1 - t0, "runner_cpu": c1 - c0, "eventbus_wall": t2 - t1,
                  "eventbus_cpu": c2 - c1, "eventbus_modules": len(set(sys.modules) - before)}))
"""


def sample(tree: Path, pycache: str | None) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = pycache
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tree)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", type=Path, required=True)
    parser.add_argument("--pycache", help="also run with PYTHONPYCACHEPREFIX=this folder")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    variants = [(t.resolve(), None) for t in args.tree]
    if args.pycache:
        variants += [(t.resolve(), args.pycache) for t in args.tree]
    got: dict[str, list[dict[str, float]]] = {}
    for i in range(args.runs):
        for tree, cache in variants:
            name = f"{tree}{' +pycache' if cache else ''}"
            one = sample(tree, cache)
            got.setdefault(name, []).append(one)
            print(i + 1, name, {k: round(v, 3) for k, v in one.items()}, flush=True)
    result = {
        name: {k: round(statistics.median(s[k] for s in runs), 3) for k in runs[0]}
        for name, runs in got.items()
    }
    result["load"] = os.getloadavg()[0]  # type: ignore[assignment]
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
