"""A/B of the ``eventbus offload --once`` command of two revisions on flights, alternated.

    python stress/offload_cli.py base-s7 HEAD --pairs 3 --events 336776

For each run: the database of a private redis-server is flushed and the flights are published
to topic ``bench`` (16 shards; by this checkout's code, not timed), the raw I/O loop of
``stress/tier_bench.py`` (`offload_ceiling`: XRANGE pages -> raw-field table -> zstd Parquet)
reads them once (the ceiling of this run), then ``eventbus offload --once`` of the revision
archives them to a fresh folder in its own process, typed columns and ``rebuild_data`` on (as
tier_bench's offload). The command runs with the revision's ``eventbus`` first on
``PYTHONPATH`` (`ab.tree`); its wall and CPU time (all threads) are taken inside that process
from just before the command is called (the interpreter start and ``eventbus.cli``'s import
are left out, the command's own imports and set-up are in). Prints per revision the median
entries/s, ``ratio_ceiling`` (entries/s over the same run's ceiling), CPU us per entry, and the
ratios B/A; the runs with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from ab import tree
from tier_bench import offload_ceiling

from eventbus import EventBus, Settings
from localredis.server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 16

CHILD = """
import json, sys, time
from eventbus.cli import app
out = sys.argv.pop(1)
started, cpu = time.perf_counter(), time.process_time()
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    with open(out, "w") as f:
        json.dump({"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}, f)
"""


async def publish(url: str, data: list[Any]) -> int:
    bus = EventBus(Settings(redis_url=url, shards=SHARDS, maxlen=10_000_000))
    await bus.redis.flushdb()
    async with bus:
        for i in range(0, len(data), 20_000):
            await bus.publish_many("bench", data[i : i + 20_000])
    streams = [bus.keys.stream("bench", s) for s in range(SHARDS)]
    started = time.perf_counter()
    entries = await offload_ceiling(bus.redis, streams, 2000, 100_000)
    ceiling = entries / (time.perf_counter() - started)
    await bus.aclose()
    return round(ceiling)


async def left(url: str) -> int:
    bus = EventBus(Settings(redis_url=url, shards=SHARDS))
    n = sum([await bus.redis.xlen(bus.keys.stream("bench", s)) for s in range(SHARDS)])
    await bus.aclose()
    return n


def run_once(side: Any, url: str, data: list[Any], model: str) -> dict[str, Any]:
    ceiling = anyio.run(publish, url, data)
    with tempfile.TemporaryDirectory(prefix="offload-cli-") as tmp:
        out = Path(tmp) / "times.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(side.pkg), str(ROOT))),
            "PYTHONSAFEPATH": "1",
            "REDIS_URL": url,
            "EVENTBUS_TIER_TYPED_MODELS": json.dumps({"bench": model}),
            "EVENTBUS_TIER_TRIM_EXACT": "true",
            "EVENTBUS_TIER_REBUILD_DATA": "true",
        }
        cmd = [sys.executable, "-c", CHILD, str(out), "offload", "--once"]
        cmd += ["--store", str(Path(tmp) / "store"), "--hot-window-s", "0"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
            raise RuntimeError(f"eventbus offload of {side.label} failed")
        times = json.loads(out.read_text())
    remaining = anyio.run(left, url)
    if remaining:
        raise RuntimeError(f"{side.label}: {remaining} entries left in Redis")
    n = len(data)
    return {
        "entries_per_s": round(n / times["seconds"]),
        "ceiling_entries_per_s": ceiling,
        "ratio_ceiling": round(n / times["seconds"] / ceiling, 3),
        "cpu_us_per_entry": round(times["cpu_s"] * 1e6 / n, 2),
        "load_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--events", type=int, default=336_776)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from examples.flights.flightdata import Flight, load_flights

    data = [(r.plane, r.event()) for r in load_flights(limit=args.events)]
    model = f"{Flight.__module__}:{Flight.__qualname__}"
    sides = [tree(args.rev_a), tree(args.rev_b)]
    runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in sides}
    with RedisServer() as server:
        for pair in range(args.pairs):
            for side in sides:
                r = run_once(side, server.url, data, model)
                runs[side.label].append(r)
                print(f"pair {pair + 1} {side.label}: {json.dumps(r)}", file=sys.stderr)
    a, b = (runs[s.label] for s in sides)
    summary = {}
    for key in a[0]:
        ma, mb = statistics.median(r[key] for r in a), statistics.median(r[key] for r in b)
        summary[key] = {"a": ma, "b": mb, "b_over_a": round(mb / ma, 3) if ma else None}
    print(json.dumps({"a": sides[0].label, "b": sides[1].label, "median": summary}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
