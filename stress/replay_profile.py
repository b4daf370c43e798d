"""Replay and catch-up alone, on one store built once, for a profiler or an A/B of two trees.

    REDIS_URL=redis://127.0.0.1:6399/0 python stress/replay_profile.py build /tmp/store 336776
    python stress/replay_profile.py raw /tmp/store            # iter_topic, merged
    python stress/replay_profile.py raw_fields /tmp/store     # the same, every field read
    python stress/replay_profile.py typed /tmp/store          # iter_events (Flight)
    python stress/replay_profile.py stages /tmp/store         # CPU µs/event per stage
    REDIS_URL=... python stress/replay_profile.py catchup /tmp/store   # + the live batch rate
    REDIS_URL=... python stress/replay_profile.py catchup_only /tmp/store   # for a profiler
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
import gc
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from operator import attrgetter
from pathlib import Path
from statistics import median

import anyio

sys.path.insert(1, str(Path(__file__).resolve().parent))  # tier_bench, after PYTHONPATH

from tier_bench import batch_rate, warm_up

from eventbus import EventBus, Settings
from eventbus.protocol.codec import event_type_of
from eventbus.tier import TierSettings, iter_events, iter_topic, open_store
from eventbus.tier.archived import ArchivedEntry, EntryBatch, ReplayFilter, open_batches
from eventbus.tier.layout import SegmentRef
from eventbus.tier.offloader import offload_until_caught_up
from eventbus.tier.replay import BATCH_ROWS, _Decoder, merge_batches, plan
from eventbus.tier.store import get_bytes_sync
from examples.flights.flightdata import Flight, load_flights

SHARDS = 16
_FIELDS = (
    *("topic", "shard", "entry_id", "resource_id", "event_type", "published_at_ms"),
    *("event_id", "headers", "data", "segment"),
)


async def build(folder: str, n: int) -> dict[str, object]:
    bus = EventBus(Settings(redis_url=os.environ["REDIS_URL"], shards=SHARDS, maxlen=10_000_000))
    await bus.redis.flushdb()
    data = [(r.plane, r.event()) for r in load_flights(limit=n)]
    async with bus:
        for topic in ("bench", "bench_live"):
            for i in range(0, len(data), 20_000):
                await bus.publish_many(topic, data[i : i + 20_000])
    model = f"{Flight.__module__}:{Flight.__qualname__}"
    # version-3 segments, as stress/tier_bench.py writes them (EVENTBUS_KEEP_DATA=1: version 2)
    tier = TierSettings(
        store_url=folder,
        hot_window_s=0,
        trim_exact=True,
        typed_models={"bench": model},
        rebuild_data=os.environ.get("EVENTBUS_KEEP_DATA") != "1",
    )
    stats = await offload_until_caught_up(
        bus.redis, open_store(folder), topics=["bench"], settings=bus.settings, tier=tier
    )
    await bus.aclose()
    return {"entries": stats.entries, "segments": stats.segments}


def replay(folder: str, what: str) -> dict[str, object]:
    warm_up()
    store = open_store(folder)

    every_field = attrgetter(*_FIELDS)

    def one() -> int:
        if what == "raw":
            return sum(1 for _ in iter_topic(store, "bench"))
        if what == "raw_fields":  # a reader of every field (entries may make them lazily)
            return sum(1 for e in iter_topic(store, "bench") if every_field(e))
        return sum(1 for _ in iter_events(store, "bench", [Flight]))

    one()  # warm-up: the page cache, imports, adapters
    started, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    n = one()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    main = time.thread_time() - main
    return {
        "what": what,
        "events": n,
        "seconds": round(seconds, 3),
        "events_per_s": round(n / seconds),
        "cpu_us_per_event": round(cpu / n * 1e6, 2),
        # the consuming thread's share: what bounds the rate when the decoding threads overlap
        "main_cpu_us_per_event": round(main / n * 1e6, 2),
    }


def stages(folder: str, reps: int = 3) -> dict[str, object]:
    """CPU µs per event of replay's stages, one thread, nothing held across batches (as a
    streaming reader): each stage also does the ones before it; medians of `reps` runs."""
    warm_up()
    store = open_store(folder)
    planned = sorted(plan(store, "bench").items())
    decoder = _Decoder({event_type_of(Flight): Flight})

    def batches(refs: list[SegmentRef]) -> Iterator[EntryBatch]:
        for ref in refs:
            data = get_bytes_sync(store, ref.key)
            yield from open_batches(data, ref, ReplayFilter(), BATCH_ROWS)[1]

    def merged() -> Iterator[list[ArchivedEntry]]:
        return merge_batches([batches(refs) for _, refs in planned])

    runs: dict[str, Callable[[], int]] = {
        "decode_verify_rebuild": lambda: sum(b.n for _, r in planned for b in batches(r)),
        "entries_per_shard": lambda: sum(len(b.entries()) for _, r in planned for b in batches(r)),
        "entries_merged": lambda: sum(map(len, merged())),
        "typed_merged": lambda: sum(len(decoder.decode(lst)[0]) for lst in merged()),
        "catchup_items_per_shard": lambda: sum(
            len(b.stream_entries()[0]) for _, r in planned for b in batches(r)
        ),
    }
    if not hasattr(EntryBatch, "stream_entries"):  # a tree from before it (an A/B's base)
        del runs["catchup_items_per_shard"]
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, run in [*runs.items(), *((f"{k}_gc_off", v) for k, v in runs.items())]:
            paused = name.endswith("_gc_off")
            if paused:
                gc.disable()
            cpu = time.process_time()
            n = run()
            out.setdefault(name, []).append((time.process_time() - cpu) / n * 1e6)
            if paused:
                gc.enable()
    return {"what": "stages_cpu_us_per_event", **{k: round(median(v), 2) for k, v in out.items()}}


async def catchup(folder: str, n: int, live_too: bool = True) -> dict[str, object]:
    warm_up()
    redis = os.environ["REDIS_URL"]
    store = open_store(folder)
    tag = uuid.uuid4().hex[:6]
    cpu, main = time.process_time(), time.thread_time()
    caught, handled = await batch_rate(redis, SHARDS, "bench", f"c{tag}", n, [Flight], store)
    cpu_caught, cpu = time.process_time() - cpu, time.process_time()
    # the event loop's thread: what bounds the rate (the segments are decoded in others)
    main_caught, main = time.thread_time() - main, time.thread_time()
    caught_figures = {
        "events_per_s": round(caught),
        "cpu_us_per_event": round(cpu_caught / handled * 1e6, 2),
        "main_cpu_us_per_event": round(main_caught / handled * 1e6, 2),
    }
    if not live_too:  # for a profiler: the catch-up alone
        return {"what": "catchup_only", **caught_figures, "handled": handled}
    live, _ = await batch_rate(redis, SHARDS, "bench_live", f"l{tag}", n, [Flight])
    cpu_live, main_live = time.process_time() - cpu, time.thread_time() - main
    return {
        "what": "catchup",
        **caught_figures,
        "live_batch_events_per_s": round(live),
        "ratio_live_batch": round(caught / live, 3),
        "live_cpu_us_per_event": round(cpu_live / n * 1e6, 2),
        "live_main_cpu_us_per_event": round(main_live / n * 1e6, 2),
        "handled": handled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "step",
        choices=["build", "raw", "raw_fields", "typed", "catchup", "catchup_only", "stages"],
    )
    parser.add_argument("folder", help="the store folder")
    parser.add_argument("events", nargs="?", type=int, default=336776, help="flights")
    args = parser.parse_args()
    if args.step == "build":
        out = anyio.run(build, args.folder, args.events)
    elif args.step == "stages":
        out = stages(args.folder)
    elif args.step in ("catchup", "catchup_only"):
        out = anyio.run(catchup, args.folder, args.events, args.step == "catchup")
    else:
        out = replay(args.folder, args.step)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
