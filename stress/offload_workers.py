"""One offloader process against two, the same way: what a second process adds per entry.

    python stress/offload_workers.py --pairs 2 --events 336776

``tier_bench``'s ``offload_2_processes`` compares two worker processes with the offload run in
the benchmark's own process. Here both sides are `tier_bench.offload_processes` (the same worker
processes, GC set as ``eventbus offload`` sets it, flights with typed columns, 16 shards, a
fresh topic per run), with 1 and then 2 processes, alternated ``--pairs`` times on one
redis-server. Prints one JSON line per run: entries/s, the entries of each process, CPU per
entry of the processes together (all threads), Redis's CPU (``INFO cpu``) and the load average.
If the CPU per entry of two equals one's, the second process adds no work of its own (lock
rounds, start-up): what scaling is missing is cores the machine did not have.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import anyio
import tier_bench

from eventbus import EventBus, Settings
from localredis.server import RedisServer


async def run(url: str, data: list[Any], model: str, processes: int, topic: str) -> dict:
    bus = EventBus(Settings(redis_url=url, shards=16, maxlen=10_000_000))
    await bus.redis.flushdb()
    async with bus:
        for i in range(0, len(data), 20_000):
            await bus.publish_many(topic, data[i : i + 20_000])
    with tempfile.TemporaryDirectory(prefix="offload-workers-") as store:
        result = await tier_bench.offload_processes(
            bus.redis, topic, store, model, 16, False, processes=processes
        )
    await bus.aclose()
    return {"processes": processes, **result, "load_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--events", type=int, default=336_776)
    args = parser.parse_args()
    from examples.flights.flightdata import Flight, load_flights

    data = [(r.plane, r.event()) for r in load_flights(limit=args.events)]
    model = f"{Flight.__module__}:{Flight.__qualname__}"
    with RedisServer() as server:
        for pair in range(args.pairs):
            for n in (1, 2):
                result = anyio.run(run, server.url, data, model, n, f"w{n}_{pair}")
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
