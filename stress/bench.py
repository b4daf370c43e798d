"""Throughput and latency of eventbus against the raw Redis ceilings, measured in one run.

    python stress/bench.py [--events 200000] [--json stress/results/bench.json] [--peers]

Steps, each on a fresh private ``redis-server`` (same binary, same machine, same run):

1. ``redis-benchmark``: pipelined XADD (-P 16, 50 clients) of a 200-byte field: the server's limit.
2. raw redis-py + hiredis asyncio: XADD pipelined in batches of 1000 over 16 streams.
3. raw redis-py: XREADGROUP COUNT 500 over 16 streams + XACK + MessagePack decoding.
4. eventbus ``publish()`` from many concurrent tasks in one process (automatic coalescing).
5. eventbus, one consumer process with a no-op handler draining the published events.
6. latency: publish at a fixed rate (default 2,000 events/s) while one consumer process handles
   them; p50/p99 of publish-to-handler time (publisher wall clock to handler start, ms).

Every figure is printed with its ratio to the matching ceiling. Targets: 4 >= 0.75 x 2,
5 >= 0.6 x 3, p99 <= 5 ms at 2,000 events/s (10 ms on a Cluster), consumer peak RSS < 150 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgpack
import redis.asyncio as aioredis
from pydantic import BaseModel

from eventbus import Context, EventBus, Settings

try:
    from localredis.server import RedisServer, redis_binary
except ImportError:  # an older eventbus under test (stress/ab.py): this checkout's server helper
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_harness_server", Path(__file__).resolve().parent.parent / "localredis/server.py"
    )
    assert _spec is not None and _spec.loader is not None
    _server = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_server)
    RedisServer, redis_binary = _server.RedisServer, _server.redis_binary

PAYLOAD_CHARS = 150  # with the envelope (ID, time, headers) an entry is ~200 bytes
SHARDS = 16
TOPIC = "bench"


class Tick(BaseModel):
    seq: int
    body: str


def _event(i: int) -> Tick:
    return Tick(seq=i, body="x" * PAYLOAD_CHARS)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


# -- 1. redis-benchmark -------------------------------------------------------------------------
def redis_benchmark_xadd(events: int) -> float:
    with RedisServer() as server:
        out = subprocess.run(
            [
                redis_binary("redis-benchmark"),
                "-p",
                str(server.port),
                "-n",
                str(events),
                "-c",
                "50",
                "-P",
                "16",
                "--csv",
                "XADD",
                "rb",
                "MAXLEN",
                "~",
                "1000000",
                "*",
                "d",
                "x" * 200,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    # --csv prints a header and one row: "test","rps",...
    row = [line for line in out.splitlines() if line.startswith('"XADD')][-1]
    return float(re.findall(r'"([0-9.]+)"', row)[0])


# -- 2. and 3. raw redis-py loops ---------------------------------------------------------------
async def raw_xadd(url: str, events: int, batch: int = 1000) -> float:
    r = aioredis.Redis.from_url(url)
    data = msgpack.packb({"seq": 0, "body": "x" * PAYLOAD_CHARS})
    fields = {b"rid": b"resource", b"type": b"Tick", b"data": b"\x01" + data}
    start = time.perf_counter()
    for i in range(0, events, batch):
        pipe = r.pipeline(transaction=False)
        for j in range(i, min(events, i + batch)):
            pipe.xadd(f"raw:{j % SHARDS}", fields, maxlen=1_000_000, approximate=True)
        await pipe.execute()
    elapsed = time.perf_counter() - start
    await r.aclose()
    return events / elapsed


async def raw_read_ack(url: str, events: int) -> float:
    r = aioredis.Redis.from_url(url)
    streams = {f"raw:{s}": ">" for s in range(SHARDS)}
    for s in streams:
        await r.xgroup_create(s, "g", id="0", mkstream=True)
    done = 0
    start = time.perf_counter()
    while done < events:
        reply = await r.xreadgroup("g", "c", streams, count=500, block=100)
        pipe = r.pipeline(transaction=False)
        for stream, entries in reply or []:
            for _, fields in entries:
                msgpack.unpackb(fields[b"data"][1:])
            pipe.xack(stream, "g", *[eid for eid, _ in entries])
            done += len(entries)
        await pipe.execute()
    elapsed = time.perf_counter() - start
    await r.aclose()
    return events / elapsed


# -- 4. eventbus publish ------------------------------------------------------------------------
async def eventbus_publish(url: str, events: int, tasks: int = 1000) -> float:
    bus = EventBus(Settings(redis_url=url, shards=SHARDS))
    per_task = events // tasks
    async with bus:
        await bus.publish(TOPIC, _event(-1), resource_id="warmup")

        async def worker(t: int) -> None:
            for i in range(per_task):
                await bus.publish(TOPIC, _event(i), resource_id=f"r{t}")

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for t in range(tasks):
                tg.start_soon(worker, t)
        elapsed = time.perf_counter() - start
    await bus.aclose()
    return per_task * tasks / elapsed


# -- 5. and 6. eventbus consumer process --------------------------------------------------------
def consumer_main(url: str, expect: int, out: str) -> None:
    """Run in a child process: consume `expect` events with a no-op handler, write results."""
    bus = EventBus(Settings(redis_url=url, shards=SHARDS))
    latencies: list[float] = []
    state = {"n": 0, "first": 0.0, "last": 0.0}
    stop = anyio.Event()

    @bus.subscriber(TOPIC, group="bench")
    async def handle(event: Tick, ctx: Context) -> None:
        now = time.time()
        if state["n"] == 0:
            state["first"] = time.perf_counter()
        latencies.append(now * 1000 - ctx.published_at_ms)
        state["n"] += 1
        if state["n"] >= expect:
            state["last"] = time.perf_counter()
            stop.set()

    anyio.run(lambda: bus.run(stop=stop))
    rss_kb = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1])
    latencies.sort()
    Path(out).write_text(
        json.dumps(
            {
                "handled": state["n"],
                "events_per_s": (state["n"] - 1) / max(1e-9, state["last"] - state["first"]),
                "latency_ms_p50": _percentile(latencies, 0.50),
                "latency_ms_p99": _percentile(latencies, 0.99),
                "peak_rss_mb": rss_kb / 1024,
            }
        )
    )


def child_env() -> dict[str, str]:
    """The environment of a child process: this checkout on its path, after whatever
    ``PYTHONPATH`` already names (stress/ab.py puts the eventbus under test first)."""
    paths = [p for p in (os.environ.get("PYTHONPATH"), str(Path(__file__).resolve().parent.parent))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _spawn_consumer(url: str, expect: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, __file__, "_consumer", url, str(expect), str(out)],
        env=child_env(),
    )


async def command_calls(url: str) -> dict[str, int]:
    """Calls of each command so far on the server at `url` (INFO commandstats)."""
    r = aioredis.Redis.from_url(url)
    stats = await r.info("commandstats")
    await r.aclose()
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def calls_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The consumer's Redis round trips that scale with its rounds: EVALSHA (a lock round per
    read round, heartbeats, releases) and XREADGROUP."""
    return {c: after.get(c, 0) - before.get(c, 0) for c in ("evalsha", "xreadgroup")}


async def eventbus_consume(url: str, out: Path) -> dict[str, Any]:
    """Consume everything already published to TOPIC (by step 4) in one consumer process."""
    r = aioredis.Redis.from_url(url)
    total = sum([await r.xlen(f"eventbus:stream:{TOPIC}:{s}") for s in range(SHARDS)])
    await r.aclose()
    before = await command_calls(url)
    proc = _spawn_consumer(url, total, out)
    await anyio.to_thread.run_sync(proc.wait)
    return json.loads(await anyio.Path(out).read_text()) | {
        "redis_calls": calls_between(before, await command_calls(url))
    }


async def eventbus_latency(url: str, rate: int, seconds: float, out: Path) -> dict[str, Any]:
    events = int(rate * seconds)
    before = await command_calls(url)
    proc = _spawn_consumer(url, events, out)
    bus = EventBus(Settings(redis_url=url, shards=SHARDS))
    async with bus:
        # Wait until the consumer has joined its group (its liveness entry exists).
        members = bus.keys.members(TOPIC, "bench")
        with anyio.fail_after(30):
            while not await bus.redis.zcard(members):  # noqa: ASYNC110 (state in Redis)
                await anyio.sleep(0.01)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(events):
                tg.start_soon(lambda i=i: bus.publish(TOPIC, _event(i), resource_id=f"r{i % 500}"))
                delay = start + (i + 1) / rate - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
    await bus.aclose()
    await anyio.to_thread.run_sync(proc.wait)
    return json.loads(await anyio.Path(out).read_text()) | {
        "redis_calls": calls_between(before, await command_calls(url))
    }


# -- report -------------------------------------------------------------------------------------
async def main(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"events": args.events, "payload_chars": PAYLOAD_CHARS, "shards": SHARDS}
    print("1/6 redis-benchmark XADD -P 16 -c 50 ...", flush=True)
    res["redis_benchmark_xadd_per_s"] = await anyio.to_thread.run_sync(
        redis_benchmark_xadd, args.events
    )
    tmp = Path(args.json).parent
    with RedisServer() as server:
        print("2/6 raw pipelined XADD ...", flush=True)
        res["raw_xadd_pipelined_per_s"] = await raw_xadd(server.url, args.events)
        print("3/6 raw XREADGROUP + XACK ...", flush=True)
        res["raw_read_ack_per_s"] = await raw_read_ack(server.url, args.events)
    with RedisServer() as server:
        print("4/6 eventbus publish() from 1000 concurrent tasks ...", flush=True)
        res["eventbus_publish_per_s"] = await eventbus_publish(server.url, args.events)
        print("5/6 eventbus consumer process, no-op handler ...", flush=True)
        res["consume"] = await eventbus_consume(server.url, tmp / "consume.tmp.json")
    with RedisServer() as server:
        print(f"6/6 latency at {args.rate} events/s for {args.seconds} s ...", flush=True)
        res["latency"] = await eventbus_latency(
            server.url, args.rate, args.seconds, tmp / "latency.tmp.json"
        )
    for f in tmp.glob("*.tmp.json"):
        f.unlink()
    res["ratios"] = {
        "publish_vs_raw_pipelined": res["eventbus_publish_per_s"] / res["raw_xadd_pipelined_per_s"],
        "publish_vs_redis_benchmark": res["eventbus_publish_per_s"]
        / res["redis_benchmark_xadd_per_s"],
        "consume_vs_raw_read_ack": res["consume"]["events_per_s"] / res["raw_read_ack_per_s"],
    }
    return res


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    r = res["ratios"]
    t = Table("measure", "value", "ratio", "target", title="eventbus benchmark (one run)")
    t.add_row(
        "redis-benchmark XADD -P16 -c50",
        f"{res['redis_benchmark_xadd_per_s']:,.0f}/s",
        "1.00 (server limit)",
        "",
    )
    t.add_row(
        "raw redis-py pipelined XADD",
        f"{res['raw_xadd_pipelined_per_s']:,.0f}/s",
        f"{res['raw_xadd_pipelined_per_s'] / res['redis_benchmark_xadd_per_s']:.2f} x rb",
        "",
    )
    t.add_row("raw XREADGROUP+XACK+decode", f"{res['raw_read_ack_per_s']:,.0f}/s", "", "")
    t.add_row(
        "eventbus publish() concurrent",
        f"{res['eventbus_publish_per_s']:,.0f}/s",
        f"{r['publish_vs_raw_pipelined']:.2f} x raw",
        ">= 0.75 x raw",
    )
    t.add_row(
        "eventbus consumer (1 process)",
        f"{res['consume']['events_per_s']:,.0f}/s",
        f"{r['consume_vs_raw_read_ack']:.2f} x raw",
        ">= 0.6 x raw",
    )
    lat = res["latency"]
    t.add_row(
        "latency p50 / p99 at rate",
        f"{lat['latency_ms_p50']:.2f} / {lat['latency_ms_p99']:.2f} ms",
        "",
        "p99 <= 5 ms",
    )
    t.add_row("consumer peak RSS", f"{res['consume']['peak_rss_mb']:.0f} MB", "", "< 150 MB")
    for step, label in (("consume", "draining"), ("latency", "at rate")):
        calls = res[step].get("redis_calls")
        if calls:
            per_k = {c: n * 1000 / max(1, res[step]["handled"]) for c, n in calls.items()}
            t.add_row(
                f"EVALSHA / XREADGROUP, {label}",
                f"{per_k['evalsha']:.1f} / {per_k['xreadgroup']:.1f} per 1,000 events",
                "",
                "",
            )
    Console().print(t)


def run_cluster_mode(args: argparse.Namespace) -> None:
    """``--cluster``: single-node vs cluster latency and CPU per event, one run."""
    import cluster_bench

    result = asyncio.run(cluster_bench.cluster_vs_single(args, eventbus_latency))
    Path(args.json).write_text(json.dumps(result, indent=2))
    cluster_bench.report(result)
    print(f"written {args.json}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_consumer":
        consumer_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=2000, help="events/s for the latency step")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency step")
    parser.add_argument("--json", default="stress/results/bench.json")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also FastStream, batch handlers, "
        "1/2/4 consumer processes, flights bytes per entry (stress/peers.py)",
    )
    parser.add_argument(
        "--single-events", type=int, default=20_000, help="events of the slow one-by-one peer steps"
    )
    parser.add_argument("--flights", type=int, default=50_000, help="flights entries measured")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="only the latency step, on one "
        "Redis and on a 3-primary cluster (stress/cluster_bench.py)",
    )
    args = parser.parse_args()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if args.cluster:
        run_cluster_mode(args)
        sys.exit(0)
    result = asyncio.run(main(args))
    if args.peers:
        import peers

        result["peers"] = asyncio.run(peers.run(args, result))
        result |= peers.summary(result["peers"])
    Path(args.json).write_text(json.dumps(result, indent=2))
    report(result)
    if args.peers:
        peers.report(result)
    print(f"written {args.json}")
