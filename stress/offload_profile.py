"""The offloader alone, for a profiler: publish flights, then offload them in another process.

    REDIS_URL=redis://127.0.0.1:6399/0 python stress/offload_profile.py publish 200000
    py-spy record -r 200 -o flame.svg -- python stress/offload_profile.py offload /tmp/store

``publish`` FLUSHES the database and publishes the first N flights to topic ``bench`` (16
shards); ``offload`` archives them to the folder given (typed columns, as the flights job;
``--untyped``: without) after a warm-up (pyarrow imports pandas on first use), and prints
entries/s, the process's CPU (all threads) per entry and stored bytes per entry as JSON. Run
it under another tree's ``eventbus`` with ``PYTHONPATH`` (the A/B harness's
``.cache/ab/pkg-<sha>``) for the flame graph of a base.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import anyio

from eventbus import EventBus, Settings
from eventbus.protocol.ids import EntryId
from eventbus.tier import TierSettings, open_store
from eventbus.tier.offloader import offload_until_caught_up

try:  # the write side's own module (segment.py held it before)
    from eventbus.tier.segment_write import encode_segment
except ImportError:
    from eventbus.tier.segment import encode_segment  # type: ignore[no-redef,attr-defined]
from examples.flights.flightdata import Flight, load_flights


async def main(args: argparse.Namespace) -> None:
    bus = EventBus(Settings(redis_url=os.environ["REDIS_URL"], shards=16, maxlen=10_000_000))
    if args.step == "publish":
        await bus.redis.flushdb()
        data = [(r.plane, r.event()) for r in load_flights(limit=int(args.arg))]
        async with bus:
            for i in range(0, len(data), 20_000):
                await bus.publish_many("bench", data[i : i + 20_000])
        await bus.aclose()
        return
    one = EntryId(1, 0)  # warm-up
    encode_segment("warm", 0, one, one, [(one, {b"rid": b"r", b"type": b"t", b"data": b"\x01"})])
    typed = {} if args.untyped else {"bench": f"{Flight.__module__}:{Flight.__qualname__}"}
    tier = TierSettings(store_url=args.arg, hot_window_s=0, trim_exact=True, typed_models=typed)
    started, cpu = time.perf_counter(), time.process_time()
    stats = await offload_until_caught_up(
        bus.redis, open_store(args.arg), settings=bus.settings, tier=tier
    )
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu  # all threads: comparable under load, unlike wall time
    await bus.aclose()
    print(
        json.dumps(
            {
                "entries": stats.entries,
                "seconds": round(seconds, 3),
                "entries_per_s": round(stats.entries / seconds),
                "cpu_us_per_entry": round(cpu * 1e6 / max(1, stats.entries), 2),
                "stored_bytes_per_entry": round(stats.stored_bytes / max(1, stats.entries), 1),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("step", choices=["publish", "offload"])
    parser.add_argument("arg", help="publish: how many flights; offload: the store folder")
    parser.add_argument("--untyped", action="store_true")
    anyio.run(main, parser.parse_args())
