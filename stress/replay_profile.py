"""Replay and catch-up alone, on one store built once, for a profiler or an A/B of two trees.

    REDIS_URL=redis://127.0.0.1:6399/0 python stress/replay_profile.py build /tmp/store 336776
    python stress/replay_profile.py raw /tmp/store            # iter_topic, merged
    python stress/replay_profile.py typed /tmp/store          # iter_events (Flight)
    REDIS_URL=... python stress/replay_profile.py catchup /tmp/store   # + the live batch rate
    py-spy record -r 200 -o flame.svg -- python stress/replay_profile.py raw /tmp/store

``build`` FLUSHES the database, publishes the first N flights to topics ``bench`` and
``bench_live`` (16 shards) and offloads ``bench`` to the folder (typed columns, as the flights
job; Redis keeps the emptied streams and the offloader's checkpoints, which catch-up reads).
``raw`` / ``typed`` time one pass of `iter_topic` / `iter_events` after a warm-up pass and
print events/s and the process's CPU time per event (steadier than wall time on a shared
machine) as JSON; ``catchup`` times `catch_up` of a new group at ``0`` (behind the
archive) into a no-op batch subscriber (``max_batch=500``), then the live batch consumer on
``bench_live``, as `stress/tier_bench.py` does. Run it under another tree's ``eventbus`` with
``PYTHONPATH`` for an A/B (the same store, alternated runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

import anyio

sys.path.insert(1, str(Path(__file__).resolve().parent))  # tier_bench, after PYTHONPATH

from tier_bench import batch_rate, warm_up

from eventbus import EventBus, Settings
from eventbus.tier import TierSettings, iter_events, iter_topic, open_store
from eventbus.tier.offloader import offload_until_caught_up
from examples.flights.flightdata import Flight, load_flights

SHARDS = 16


async def build(folder: str, n: int) -> dict[str, object]:
    bus = EventBus(Settings(redis_url=os.environ["REDIS_URL"], shards=SHARDS, maxlen=10_000_000))
    await bus.redis.flushdb()
    data = [(r.plane, r.event()) for r in load_flights(limit=n)]
    async with bus:
        for topic in ("bench", "bench_live"):
            for i in range(0, len(data), 20_000):
                await bus.publish_many(topic, data[i : i + 20_000])
    model = f"{Flight.__module__}:{Flight.__qualname__}"
    tier = TierSettings(
        store_url=folder, hot_window_s=0, trim_exact=True, typed_models={"bench": model}
    )
    stats = await offload_until_caught_up(
        bus.redis, open_store(folder), topics=["bench"], settings=bus.settings, tier=tier
    )
    await bus.aclose()
    return {"entries": stats.entries, "segments": stats.segments}


def replay(folder: str, what: str) -> dict[str, object]:
    warm_up()
    store = open_store(folder)

    def one() -> int:
        if what == "raw":
            return sum(1 for _ in iter_topic(store, "bench"))
        return sum(1 for _ in iter_events(store, "bench", [Flight]))

    one()  # warm-up: the page cache, imports, adapters
    started, cpu = time.perf_counter(), time.process_time()
    n = one()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {
        "what": what,
        "events": n,
        "seconds": round(seconds, 3),
        "events_per_s": round(n / seconds),
        "cpu_us_per_event": round(cpu / n * 1e6, 2),
    }


async def catchup(folder: str, n: int) -> dict[str, object]:
    warm_up()
    redis = os.environ["REDIS_URL"]
    store = open_store(folder)
    tag = uuid.uuid4().hex[:6]
    cpu = time.process_time()
    caught, handled = await batch_rate(redis, SHARDS, "bench", f"c{tag}", n, [Flight], store)
    cpu_caught, cpu = time.process_time() - cpu, time.process_time()
    live, _ = await batch_rate(redis, SHARDS, "bench_live", f"l{tag}", n, [Flight])
    cpu_live = time.process_time() - cpu
    return {
        "what": "catchup",
        "events_per_s": round(caught),
        "live_batch_events_per_s": round(live),
        "ratio_live_batch": round(caught / live, 3),
        "cpu_us_per_event": round(cpu_caught / handled * 1e6, 2),
        "live_cpu_us_per_event": round(cpu_live / n * 1e6, 2),
        "handled": handled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("step", choices=["build", "raw", "typed", "catchup"])
    parser.add_argument("folder", help="the store folder")
    parser.add_argument("events", nargs="?", type=int, default=336776, help="flights")
    args = parser.parse_args()
    if args.step == "build":
        out = anyio.run(build, args.folder, args.events)
    elif args.step == "catchup":
        out = anyio.run(catchup, args.folder, args.events)
    else:
        out = replay(args.folder, args.step)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
