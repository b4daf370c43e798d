"""The consumer processes of the flights demo, run as
``python -m examples.flights.workers '<config JSON>'`` with a pipe from the parent as stdin (the
worker stops when it closes).

Each process runs one `EventBus` with one *batch* subscriber (``batch=True``), in one of two
consumer groups:

* ``order-check``: checks that each plane's flights arrive strictly in ``seq`` order;
* ``aggregate``: per-carrier flight counts and departure-delay sums.

Both record their effect in Redis with a Lua script (``order_check.lua``, ``aggregate.lua``),
atomically per event and *idempotently*: a bitmap of handled publish indices (``SETBIT`` returns
the old bit) tells a first delivery from a redelivery, so a duplicate is counted, never applied
twice. The order check must be shared by all
processes of the group, because a plane's shard moves between them (idle shards are released, the
fair share changes): Redis holds each plane's highest handled ``seq``.

One handler call gets up to `MAX_BATCH` consecutive entries of one shard, in stream order, and
makes one ``EVALSHA`` with all of them (one JSON argument: redis-py packs arguments in pure
Python, which costs more than the script); the script still checks and records each event on
its own, in that order. A shard's batches run one after another and are acked after the handler
returned (docs/semantics.md, "Batch handlers"), and a plane's flights are all in its shard, so
the order Redis sees is the order of each plane's stream entries, whichever process handled
them: a takeover hands the next owner the unacked entries first. A failed or retried call is
safe: the bitmap makes every re-applied event a duplicate. On SIGTERM the bus shuts down
gracefully, then the process writes its report (events delivered, first/last handling time,
every publish-to-handler latency) to Redis.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from array import array
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import anyio
from redis.exceptions import RedisError

from eventbus.app import EventBus
from eventbus.config import Settings
from eventbus.consumer import Context
from examples.flights.flightdata import Flight

log = logging.getLogger("examples.flights")

ORDER_GROUP = "order-check"
AGGREGATE_GROUP = "aggregate"
GROUPS = (ORDER_GROUP, AGGREGATE_GROUP)

# Script result codes, one per event.
IN_ORDER, DUPLICATE, OUT_OF_ORDER = 0, 1, 2

# The groups' scripts (KEYS/ARGV documented in each file), beside this module.
_HERE = Path(__file__).resolve().parent
ORDER_LUA = (_HERE / "order_check.lua").read_text()
AGGREGATE_LUA = (_HERE / "aggregate.lua").read_text()


@dataclass(frozen=True, slots=True)
class DemoKeys:
    """The demo's own Redis keys (application data, beside eventbus's keys): one hashtag per run,
    so each Lua script touches one Cluster slot, and the run's topic name in every key, so runs
    on a shared server never mix."""

    prefix: str
    topic: str

    @property
    def _base(self) -> str:
        return f"{self.prefix}:demo:{{{self.topic}}}"

    @property
    def last_seq(self) -> str:
        return f"{self._base}:last-seq"

    @property
    def aggregates(self) -> str:
        return f"{self._base}:aggregates"

    def seen(self, group: str) -> str:
        return f"{self._base}:seen:{group}"

    def counters(self, group: str) -> str:
        return f"{self._base}:counters:{group}"

    def report(self, worker: str) -> str:
        return f"{self._base}:report:{worker}"

    def all(self, workers: list[str]) -> list[str]:
        return [
            self.last_seq,
            self.aggregates,
            *(self.seen(g) for g in GROUPS),
            *(self.counters(g) for g in GROUPS),
            *(self.report(w) for w in workers),
        ]


MAX_BATCH = 500
"""`max_batch` of the workers' batch subscribers: entries per handler call (one ``EVALSHA``)."""

LINGER_MS = 30
"""`read_linger_ms` of the job's consumers (unless ``EVENTBUS_READ_LINGER_MS`` says otherwise):
a batch job trades a few ms of latency for fewer, larger reads, acks and Lua batches (consumer
CPU per event 67-72 us without, 51-55 us with it, runs of 100,000 flights on 2 cores)."""


def settings_for(redis_url: str, shards: int) -> Settings:
    """`Settings` from the environment (``EVENTBUS_*``) with the run's Redis and shard count,
    and `LINGER_MS`."""
    overrides: dict[str, Any] = {"redis_url": redis_url, "shards": shards}
    if "EVENTBUS_READ_LINGER_MS" not in os.environ:
        overrides["read_linger_ms"] = LINGER_MS
    return Settings(**overrides)  # a dict, since mypy has no pydantic plugin here


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a worker process needs, passed as JSON on its command line."""

    name: str
    group: str
    redis_url: str
    topic: str
    shards: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))


@dataclass(slots=True)
class Report:
    """What a worker tells the parent when it stops. Times are Unix ms (wall clock)."""

    name: str
    group: str
    pid: int
    calls: int = 0  # events delivered to the handler, duplicates included
    batches: int = 0  # handler calls (batches)
    duplicates: int = 0
    violations: int = 0
    first_ms: float = 0.0  # first handler call
    last_ms: float = 0.0  # last handler completion
    cpu_s: float = 0.0  # CPU time of the whole process (user + system), seconds
    setup_cpu_s: float = 0.0  # of which before the first handler call (imports, start-up)
    latencies_ms: array[float] = field(default_factory=lambda: array("d"))

    def to_redis(self) -> dict[str, bytes | str]:
        meta = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latencies_ms"}
        return {"meta": json.dumps(meta), "latencies_ms": self.latencies_ms.tobytes()}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> Report:
        report = cls(**json.loads(raw[b"meta"]))
        report.latencies_ms.frombytes(raw[b"latencies_ms"])
        return report


async def run_worker(cfg: WorkerConfig) -> None:
    """Consume the demo topic in `cfg.group` until SIGTERM/SIGINT, then write the `Report`."""
    bus = EventBus(settings_for(cfg.redis_url, cfg.shards))
    keys = DemoKeys(bus.settings.key_prefix, cfg.topic)
    report = Report(cfg.name, cfg.group, os.getpid())
    if cfg.group == ORDER_GROUP:
        script = bus.redis.register_script(ORDER_LUA)
        script_keys = [keys.last_seq, keys.seen(cfg.group), keys.counters(cfg.group)]

        def script_args(ev: Flight) -> tuple[str | int | None, ...]:
            return ev.plane, ev.seq, ev.position

    else:
        script = bus.redis.register_script(AGGREGATE_LUA)
        script_keys = [keys.seen(cfg.group), keys.aggregates, keys.counters(cfg.group)]

        def script_args(ev: Flight) -> tuple[str | int | None, ...]:
            return ev.position, ev.carrier, ev.dep_delay

    latencies = report.latencies_ms

    @bus.subscriber(cfg.topic, group=cfg.group, batch=True, max_batch=MAX_BATCH)
    async def on_flights(events: list[Flight], ctxs: list[Context]) -> None:
        now_ms = time.time() * 1000
        if ctxs[0].attempt == 1:  # latency of the delivery, not of a retry
            latencies.extend(array("d", [now_ms - ctx.published_at_ms for ctx in ctxs]))
        if not report.first_ms:
            report.first_ms = now_ms
            report.setup_cpu_s = time.process_time()
        report.calls += len(events)
        report.batches += 1
        codes = await script(
            keys=script_keys, args=[json.dumps([script_args(ev) for ev in events])]
        )
        for ev, code in zip(events, codes, strict=True):
            if code == DUPLICATE:
                report.duplicates += 1
            elif code == OUT_OF_ORDER:
                report.violations += 1
                log.error("plane %s: seq %d handled after a later flight", ev.plane, ev.seq)
        report.last_ms = time.time() * 1000

    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_when_orphaned, stop)
            await bus.run(stop=stop, handle_signals=True)  # returns after a graceful shutdown
            tg.cancel_scope.cancel()
        report.cpu_s = time.process_time()
        try:
            await bus.redis.hset(keys.report(cfg.name), mapping=report.to_redis())
        except (RedisError, OSError) as exc:  # e.g. a private server stopped by Ctrl-C
            log.warning("could not write the report to Redis: %s", exc)
    finally:
        await bus.aclose()


async def _stop_when_orphaned(stop: anyio.Event) -> None:
    """Set `stop` when stdin reaches end of file: the parent holds the pipe's other end, so the
    pipe closes when the parent exits, even if it was killed before it could SIGTERM us."""
    await anyio.wait_readable(sys.stdin.fileno())
    log.warning("parent process is gone: stopping")
    stop.set()


def main() -> None:
    cfg = WorkerConfig.from_json(sys.argv[1])
    logging.basicConfig(
        level=logging.WARNING, format=f"[{cfg.name}] %(levelname)s %(name)s: %(message)s"
    )
    anyio.run(run_worker, cfg)


if __name__ == "__main__":
    main()
