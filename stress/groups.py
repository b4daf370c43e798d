"""Many consumer groups in one process: idle cost and fan-out latency.

    python stress/groups.py [--groups 100] [--shards 16] [--idle-s 10] [--json F]

On a private ``redis-server``, one process runs `--groups` subscribers of one topic, one group
each (each its own `Consumer`: lock rounds, heartbeats, reads). After they have joined it
measures, while nothing is published for `--idle-s` seconds, the process's CPU use (% of one
core) and the Redis server's, and the process's resident memory; then publishes one event and
measures the time until every group's handler has it (fan-out latency, ms), five times, with
its breakdown: when `publish` returned (``fanout_publish_ms``), when the first and the median
group's handler started (``fanout_first_ms``, ``fanout_half_ms``: a late first means late
wake-ups, a spread from first to last means the groups' work queued on the one event loop) and
the process CPU spent until the last (``fanout_cpu_ms``: near the latency on a quiet machine,
the fan-out is CPU-bound). While idle it also reports the Redis commands the groups send
(``idle_commands_per_s``, and ``idle_top_commands``: per command calls and µs of Redis time per
second, ``INFO commandstats``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from localredis.server import RedisServer


class Ping(BaseModel):
    n: int


async def measure(url: str, groups: int, shards: int, idle_s: float) -> dict[str, Any]:
    bus = EventBus(Settings(redis_url=url, shards=shards))
    got: dict[int, set[str]] = {}
    starts: dict[int, list[float]] = {}  # each group's handler start (perf_counter), by event
    arrived = anyio.Event()

    def handler_of(name: str) -> Any:
        async def handle(event: Ping) -> None:
            starts.setdefault(event.n, []).append(time.perf_counter())
            seen = got.setdefault(event.n, set())
            seen.add(name)
            if len(seen) == groups:
                arrived.set()

        return handle

    for g in range(groups):
        bus.subscriber("fanout", group=f"g{g}")(handler_of(f"g{g}"))
    stop = anyio.Event()
    result: dict[str, Any] = {"groups": groups, "shards": shards, "idle_s": idle_s}
    async with bus, anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        members = [bus.keys.members("fanout", f"g{g}") for g in range(groups)]
        # a client of its own: the bus's connections are its consumers' (100 blocking reads)
        probe = redis.asyncio.Redis.from_url(url)
        with anyio.fail_after(120):
            while not all([await probe.zcard(m) for m in members]):  # noqa: ASYNC110
                await anyio.sleep(0.1)
        await anyio.sleep(1.0)  # past the first lock rounds
        await probe.config_resetstat()  # commandstats from here
        info = await probe.info("cpu")
        redis_before = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await anyio.sleep(idle_s)
        wall = time.monotonic() - wall_before
        stats = await probe.info("commandstats")
        idle = {
            k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in stats.items()
            if k.removeprefix("cmdstat_").split("|")[0] not in ("info", "config", "zcard")
        }
        top = sorted(idle.items(), key=lambda kv: -kv[1][1])
        result["idle_commands_per_s"] = round(sum(c for c, _ in idle.values()) / wall, 1)
        result["idle_top_commands"] = {  # per second: calls, and µs of Redis time
            k: {"calls": round(c / wall, 1), "usec": round(u / wall)} for k, (c, u) in top[:8]
        }
        result["idle_cpu_percent"] = 100 * (time.process_time() - cpu_before) / wall
        info = await probe.info("cpu")
        redis_after = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        result["idle_redis_cpu_percent"] = 100 * (redis_after - redis_before) / wall
        result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        latencies, published, firsts, halves, cpus = [], [], [], [], []
        for n in range(5):
            arrived = anyio.Event()
            start, cpu = time.perf_counter(), time.process_time()
            await bus.publish("fanout", Ping(n=n), resource_id=f"r{n}")
            published.append((time.perf_counter() - start) * 1000)
            with anyio.fail_after(60):
                await arrived.wait()
            latencies.append((time.perf_counter() - start) * 1000)
            cpus.append((time.process_time() - cpu) * 1000)
            firsts.append((min(starts[n]) - start) * 1000)
            halves.append((statistics.median(starts[n]) - start) * 1000)
            await anyio.sleep(0.5)
        result["fanout_ms_median"] = statistics.median(latencies)
        result["fanout_ms_max"] = max(latencies)
        result["fanout_publish_ms"] = statistics.median(published)
        result["fanout_first_ms"] = statistics.median(firsts)
        result["fanout_half_ms"] = statistics.median(halves)
        result["fanout_cpu_ms"] = statistics.median(cpus)
        stop.set()
        await probe.aclose()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with RedisServer() as server:
        res = anyio.run(measure, server.url, a.groups, a.shards, a.idle_s)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
