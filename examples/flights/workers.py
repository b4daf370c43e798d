"""The consumer processes of the flights demo, run as
``python -m examples.flights.workers '<config JSON>'`` with a pipe from the parent as stdin (the
worker stops when it closes).

Each process runs one `EventBus` with one subscriber, in one of two consumer groups:

* ``order-check``: checks that each plane's flights arrive strictly in ``seq`` order. A
  *per-event* subscriber (one handler call per flight): the path most subscribers take, where
  per-resource order is the consumer's work (64 workers, a queue per shard and resource, retry
  timers), so an order bug of that path shows here;
* ``aggregate``: per-carrier flight counts and departure-delay sums. A *batch* subscriber
  (``batch=True``): one handler call per run of a shard's consecutive entries.

Both record their effect in Redis with a Lua script (``order_check.lua``, ``aggregate.lua``),
atomically per event and *idempotently*: a bitmap of handled publish indices (``SETBIT`` returns
the old bit) tells a first delivery from a redelivery, so a duplicate is counted, never applied
twice. The order check must be shared by all
processes of the group, because a plane's shard moves between them (idle shards are released, the
fair share changes): Redis holds each plane's highest handled ``seq``. A per-event handler awaits
its script call, and the consumer starts a plane's next event only after that, so the order Redis
sees is the order the handlers ran in, whichever process ran them. The per-event handlers'
concurrent script calls are coalesced into one ``EVALSHA`` per batch (`Batcher`), as the
publisher coalesces XADDs; the batch handler makes one ``EVALSHA`` per call with all its
entries (one JSON argument: redis-py packs arguments in pure Python, which costs more than the
script).

A process counts each event it is given once (`Deliveries`, by publish position), whatever its
handler attempts: a retried call, or the halves of a failed batch (whose ``ctx.attempt``
restarts at 1), are not new deliveries. On SIGTERM the bus shuts down gracefully, then the
process writes its report (events delivered, first/last handling time, every publish-to-handler
latency) to Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from array import array
from collections.abc import Awaitable, Callable
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
"""`max_batch` of the ``aggregate`` batch subscriber (entries per handler call, one ``EVALSHA``)
and of the ``order-check`` `Batcher` (script calls per ``EVALSHA``)."""

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
class _Call:
    args: tuple[str | int | None, ...]
    done: asyncio.Future[int]  # its code, or the batch's Redis error


class Batcher:
    """Coalesces concurrent calls of one Lua script into one ``EVALSHA`` per batch.

    Calls queue while a batch is on the wire; the next batch carries all of them (up to
    `max_batch`), in call order, as one JSON argument (the script decodes it with ``cjson``):
    redis-py packs arguments in pure Python, which cost more than the script itself.
    `run` must be running (in the worker's task group).
    """

    def __init__(
        self,
        script: Any,
        keys: list[str],
        max_batch: int = MAX_BATCH,
        report: Report | None = None,
    ) -> None:
        self._script = script
        self._report = report  # its ``batches`` counts the EVALSHAs
        self._keys = keys
        self._max = max_batch
        self._queue: list[_Call] = []
        self._wake = anyio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # `run`'s

    async def call(self, *args: str | int | None) -> int:
        """Queue one event's arguments; returns its code once the batch ran. Raises the Redis
        error of a failed batch (the handler then fails and the consumer retries it). An
        asyncio future per call: an `anyio.Event` finds its backend on every creation, which
        cost half of a worker's CPU here."""
        assert self._loop is not None, "Batcher.run is not running"
        call = _Call(args, self._loop.create_future())
        if not self._queue:
            self._wake.set()
        self._queue.append(call)
        return await call.done

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._loop = asyncio.get_running_loop()
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._queue:
                batch, self._queue = self._queue[: self._max], self._queue[self._max :]
                if self._report is not None:
                    self._report.batches += 1
                try:
                    codes = await self._script(
                        keys=self._keys, args=[json.dumps([call.args for call in batch])]
                    )
                except (RedisError, OSError) as exc:
                    for call in batch:
                        if not call.done.done():  # (its handler may have been cancelled)
                            call.done.set_exception(exc)
                    continue
                for call, code in zip(batch, codes, strict=True):
                    if not call.done.done():
                        call.done.set_result(int(code))


@dataclass(slots=True)
class Report:
    """What a worker tells the parent when it stops. Times are Unix ms (wall clock)."""

    name: str
    group: str
    pid: int
    calls: int = 0  # events given to the handler, each once (`Deliveries`), redeliveries included
    batches: int = 0  # EVALSHAs: batch handler calls, or the order-check `Batcher`'s script calls
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


class Deliveries:
    """Counts each event a process is given once, in its `Report`: ``calls``, the
    publish-to-handler latency of its first handler attempt, and the first handling time.

    A bitmap by publish position (``Flight.position``, 0-based): a retried per-event call, or a
    batch handler's call on a half of a failed batch (``ctx.attempt`` starts again at 1 there),
    finds the event's bit set and counts nothing. A redelivery to another process (after a
    crash) is counted there: the group's ``duplicates`` come from the Lua scripts."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._bits = bytearray()

    def count(self, position: int, published_at_ms: int, now_ms: float) -> None:
        """Count the event at `position` (>= 0) given to the handler at `now_ms` (Unix ms),
        unless this process counted it already. Raises `ValueError` on a negative position."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        byte, mask = position >> 3, 1 << (position & 7)
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits) + 4096))
        if self._bits[byte] & mask:
            return
        self._bits[byte] |= mask
        report = self._report
        report.calls += 1
        report.latencies_ms.append(now_ms - published_at_ms)
        if not report.first_ms:
            report.first_ms = now_ms
            report.setup_cpu_s = time.process_time()


Script = Callable[..., Awaitable[Any]]
"""A registered Lua script (redis-py's `AsyncScript`): ``await script(keys=[...], args=[...])``."""


def order_check_handler(
    batcher: Batcher, report: Report, deliveries: Deliveries
) -> Callable[[Flight, Context], Awaitable[None]]:
    """The ``order-check`` per-event handler: records one flight through `batcher`'s coalesced
    ``order_check.lua`` call and counts a duplicate or an order violation in `report`. Raises
    the batch's Redis error (the consumer then retries the event)."""

    async def on_flight(event: Flight, ctx: Context) -> None:
        deliveries.count(event.position, ctx.published_at_ms, time.time() * 1000)
        code = await batcher.call(event.plane, event.seq, event.position)
        if code == DUPLICATE:
            report.duplicates += 1
        elif code == OUT_OF_ORDER:
            report.violations += 1
            log.error("plane %s: seq %d handled after a later flight", event.plane, event.seq)
        report.last_ms = time.time() * 1000

    return on_flight


def aggregate_handler(
    script: Script, script_keys: list[str], report: Report, deliveries: Deliveries
) -> Callable[[list[Flight], list[Context]], Awaitable[None]]:
    """The ``aggregate`` batch handler: one ``aggregate.lua`` call (``EVALSHA``) with all of a
    call's flights, in order, as one JSON argument; counts the duplicates in `report`. Raises
    the script call's Redis error (the consumer retries the batch, then splits it)."""

    async def on_flights(events: list[Flight], ctxs: list[Context]) -> None:
        now_ms = time.time() * 1000
        for ev, ctx in zip(events, ctxs, strict=True):
            deliveries.count(ev.position, ctx.published_at_ms, now_ms)
        report.batches += 1
        args = json.dumps([(ev.position, ev.carrier, ev.dep_delay) for ev in events])
        codes = await script(keys=script_keys, args=[args])
        report.duplicates += sum(1 for code in codes if code == DUPLICATE)
        report.last_ms = time.time() * 1000

    return on_flights


async def run_worker(cfg: WorkerConfig) -> None:
    """Consume the demo topic in `cfg.group` until SIGTERM/SIGINT, then write the `Report`."""
    bus = EventBus(settings_for(cfg.redis_url, cfg.shards))
    keys = DemoKeys(bus.settings.key_prefix, cfg.topic)
    report = Report(cfg.name, cfg.group, os.getpid())
    deliveries = Deliveries(report)
    batcher: Batcher | None = None
    if cfg.group == ORDER_GROUP:
        batcher = Batcher(
            bus.redis.register_script(ORDER_LUA),
            [keys.last_seq, keys.seen(cfg.group), keys.counters(cfg.group)],
            report=report,
        )
        bus.subscriber(cfg.topic, group=cfg.group)(order_check_handler(batcher, report, deliveries))
    else:
        script = bus.redis.register_script(AGGREGATE_LUA)
        script_keys = [keys.seen(cfg.group), keys.aggregates, keys.counters(cfg.group)]
        bus.subscriber(cfg.topic, group=cfg.group, batch=True, max_batch=MAX_BATCH)(
            aggregate_handler(script, script_keys, report, deliveries)
        )

    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            if batcher is not None:
                await tg.start(batcher.run)
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
