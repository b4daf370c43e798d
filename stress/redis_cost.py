"""Redis CPU per event spent on one consumer's commands, against a raw loop on the same streams.

    python stress/redis_cost.py [--rates 2000 200] [--seconds 10] [--shards 16] [--json F]

For each rate, two phases against one private ``redis-server``, each after ``CONFIG
RESETSTAT``: events published at the rate (``bus.publish_many`` every millisecond, 50 resources) for
``--seconds`` while

* ``raw``: one task reads every shard with ``XREADGROUP … COUNT 500 BLOCK 1000 STREAMS s0 … sN >``
  and acks what it read with one ``XACK`` per shard in a pipeline (the least a group consumer
  can send);
* ``eventbus``: one subscriber (``bus.run()``, default settings but the shard count) handles
  them, lock rounds, heartbeats, pending checks and all.

Redis's own time per event is the ``usec`` of ``INFO commandstats`` over the events handled,
the publisher's ``XADD`` left out (the same in both phases) and this script's ``INFO`` and
``CONFIG``. Reported per rate: ``raw_us_per_event``, ``eventbus_us_per_event``, their
``ratio_raw``, and each phase's calls and µs per event by command. `stress/bench.py --peers` writes
the 2,000 events/s figures as ``redis_us_per_event_2000``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from localredis.server import RedisServer

TOPIC, GROUP = "cost", "g"
_LEFT_OUT = ("xadd", "info", "config")


class Tick(BaseModel):
    resource: str
    seq: int


class Handled:
    """Events handled so far, and a wait until there are `n`."""

    def __init__(self) -> None:
        self.n = 0
        self._target = 0
        self._reached = anyio.Event()

    def add(self, k: int) -> None:
        self.n += k
        if self._target and self.n >= self._target:
            self._reached.set()

    async def wait_for(self, n: int, within_s: float = 60.0) -> None:
        self._target, self._reached = n, anyio.Event()
        if self.n < n:
            with anyio.fail_after(within_s):
                await self._reached.wait()


async def _stats(r: Any) -> dict[str, tuple[int, int]]:
    """Command -> (calls, usec), this script's and the publisher's commands left out."""
    out = {}
    for key, value in (await r.info("commandstats")).items():
        name = key.removeprefix("cmdstat_")
        if name.split("|")[0] not in _LEFT_OUT:
            out[name] = (int(value["calls"]), int(value["usec"]))
    return out


async def _publish(bus: EventBus, rate: int, seconds: float) -> tuple[int, float]:
    """Publish `rate` events a second for `seconds` (every millisecond, the events due, in one
    `publish_many`: a steady trickle, as a service's requests make); how many, and the rate
    reached (events/s)."""
    sent, started = 0, anyio.current_time()
    while (elapsed := anyio.current_time() - started) < seconds:
        due = range(sent, int(elapsed * rate))
        await bus.publish_many(
            TOPIC, [(f"r{i % 50}", Tick(resource=f"r{i % 50}", seq=i)) for i in due]
        )
        sent += len(due)
        await anyio.sleep(0.001)
    return sent, sent / (anyio.current_time() - started)


async def _raw_loop(r: Any, streams: list[str], handled: Handled) -> None:
    for s in streams:
        await r.xgroup_create(s, GROUP, id="0", mkstream=True)
    while True:
        reply = await r.xreadgroup(GROUP, "raw", dict.fromkeys(streams, ">"), count=500, block=1000)
        if not reply:
            continue
        pipe = r.pipeline(transaction=False)
        for stream, entries in reply:
            pipe.xack(stream, GROUP, *[entry_id for entry_id, _ in entries])
            handled.add(len(entries))
        await pipe.execute()


async def _phase(url: str, shards: int, rate: int, seconds: float, raw: bool) -> dict[str, Any]:
    r = redis.asyncio.Redis.from_url(url)
    await r.flushall()
    bus = EventBus(Settings(redis_url=url, shards=shards))
    handled = Handled()

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick) -> None:
        handled.add(1)

    streams = [bus.keys.stream(TOPIC, s) for s in range(shards)]
    async with bus, anyio.create_task_group() as tg:
        if raw:
            tg.start_soon(_raw_loop, r, streams, handled)
        else:
            tg.start_soon(bus.run)
        await bus.publish(TOPIC, Tick(resource="warm", seq=0), resource_id="warm")
        await handled.wait_for(1)  # consuming: groups made, locks taken
        await r.config_resetstat()
        sent, reached = await _publish(bus, rate, seconds)
        await handled.wait_for(sent + 1)
        stats = await _stats(r)
        tg.cancel_scope.cancel()
    await r.aclose()
    usec = sum(u for _, u in stats.values())
    return {
        "events": sent,
        "rate_reached": round(reached),
        "us_per_event": round(usec / sent, 2),
        "calls_per_event": {
            k: round(c / sent, 3) for k, (c, _) in sorted(stats.items(), key=lambda kv: -kv[1][1])
        },
        # (a script's commands count both in evalsha's usec and in their own)
        "us_per_event_by_command": {
            k: round(u / sent, 2) for k, (_, u) in sorted(stats.items(), key=lambda kv: -kv[1][1])
        },
    }


async def measure(rates: list[int], seconds: float, shards: int) -> dict[str, Any]:
    """Per rate (events/s): the raw loop's and eventbus's Redis µs per event and their ratio."""
    out: dict[str, Any] = {"shards": shards, "seconds": seconds}
    with RedisServer() as server:
        for rate in rates:
            raw = await _phase(server.url, shards, rate, seconds, raw=True)
            ours = await _phase(server.url, shards, rate, seconds, raw=False)
            out[str(rate)] = {
                "rate_reached": [raw["rate_reached"], ours["rate_reached"]],
                "raw_us_per_event": raw["us_per_event"],
                "eventbus_us_per_event": ours["us_per_event"],
                "ratio_raw": round(ours["us_per_event"] / raw["us_per_event"], 3),
                "raw_calls_per_event": raw["calls_per_event"],
                "eventbus_calls_per_event": ours["calls_per_event"],
                "raw_us_per_event_by_command": raw["us_per_event_by_command"],
                "eventbus_us_per_event_by_command": ours["us_per_event_by_command"],
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=int, nargs="+", default=[2000, 200], help="events/s")
    p.add_argument("--seconds", type=float, default=10.0, help="publishing time per phase")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = anyio.run(measure, a.rates, a.seconds, a.shards)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
