"""``stress/consumer_commands.py``: the Redis commands a group consumer sends, by phase, counted
by a private ``redis-server``'s ``INFO commandstats``.

One subscriber of a topic of ``--shards`` shards runs in ``eventbus.testing.running`` against
the server (``block_max_ms`` 50, as the in-memory test bus caps it). Phases, each after a
``CONFIG RESETSTAT``:

* start: entering the test bus and an empty ``drain()`` (group creation, the first lock round,
  recovery of the newly held shards, the trim check, the first reads);
* idle: ``--idle-s`` seconds with nothing published; counts per read round (``XREADGROUP``);
* busy: ``--events`` events on 50 resources published and drained; counts per event;
* stop: leaving the test bus.

``INFO`` and ``CONFIG`` (this script's own) are left out. Run:
``.venv/bin/python stress/consumer_commands.py [--shards 16] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio
import redis.asyncio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from eventbus.testing import running
from localredis.server import RedisServer


class Tick(BaseModel):
    resource: str
    seq: int


async def _counts(r: Any) -> dict[str, int]:
    stats = await r.info("commandstats")
    out = {}
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        if name.split("|")[0] in ("info", "config"):
            continue
        out[name] = int(value["calls"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def _phase(r: Any) -> None:
    await r.config_resetstat()


async def main(shards: int, idle_s: float, events: int) -> dict[str, Any]:
    out: dict[str, Any] = {"shards": shards}
    with RedisServer() as server:
        r = redis.asyncio.Redis.from_url(server.url)
        bus = EventBus(Settings(redis_url=server.url, shards=shards, block_max_ms=50))
        seen = 0

        @bus.subscriber("t", group="g")
        async def handle(event: Tick) -> None:
            nonlocal seen
            seen += 1

        await _phase(r)
        async with running(bus, redis=server.url) as tb:
            await tb.drain()
            out["start"] = await _counts(r)
            await _phase(r)
            await anyio.sleep(idle_s)
            idle = await _counts(r)
            rounds = max(1, idle.get("xreadgroup", 0))
            out["idle"] = idle
            out["idle_per_round"] = {k: round(v / rounds, 2) for k, v in idle.items()}
            await _phase(r)
            for i in range(events):
                await bus.publish("t", Tick(resource=f"r{i % 50}", seq=i), resource_id=f"r{i % 50}")
            await tb.drain()
            busy = await _counts(r)
            out["busy"] = busy
            out["busy_per_event"] = {k: round(v / events, 3) for k, v in busy.items()}
            await _phase(r)
        out["stop"] = await _counts(r)
        await r.aclose()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the JSON object to this file")
    args = parser.parse_args()
    result = anyio.run(main, args.shards, args.idle_s, args.events)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
