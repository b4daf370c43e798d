"""The worker processes of a chaos run (chaos.py starts this file as ``roles.py _consumer CFG``
or ``roles.py _publisher CFG``): a consumer records every handler run in its ledger, a publisher
every publish Redis acknowledged (or that raised); see ledger.py for the line formats.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import locktrace
from ledger import EXITED, HANDLED, HELLO, PUBLISH_FAILED, PUBLISHED, RAISED, READY, LineWriter
from pydantic import BaseModel

from eventbus import Context, EventBus, PublishError, Settings

TOPIC, GROUP, SHARDS = "chaos", "ledger", 16


class Step(BaseModel):
    """The `s`-th event of resource `r`. `poison`: the handler raises; `slow_ms`: it sleeps."""

    r: str
    s: int
    poison: bool = False
    slow_ms: float = 0.0
    pad: str = ""


class PoisonEvent(Exception):
    """Raised by the handler for every attempt at a poison event."""


def _peak_rss_kb() -> int:
    match = re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match[1]) if match else 0


async def consumer_role(cfg: dict[str, Any]) -> None:
    """One consumer process: a bus with one subscriber that records every handler run."""
    led = LineWriter(Path(cfg["ledger"]))
    locktrace.install(Path(cfg["ledger"]).with_suffix(".trace"))
    bus = EventBus(Settings(**cfg["settings"]))

    announced = False

    def fenced(shard: int, token: int) -> str:
        """Whether the library's fence holds at the handler's first line: "1" when the lease
        is valid and the shard is held under `token`, else "0" ("-" if the consumer's internals
        changed). A run whose fence no longer holds here was stopped between the library's check
        and this line (FINDINGS 7); one whose fence holds had a lease the library trusted."""
        consumer: Any = bus.consumers[0]  # the one subscription's `Consumer`
        try:
            held = consumer.table.held.get(shard)
            return "1" if consumer.lease.ok() and held is not None and held.token == token else "0"
        except AttributeError:
            return "-"

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Step, ctx: Context) -> None:
        nonlocal announced
        start = time.time_ns()
        fence = fenced(ctx.shard, ctx.fencing_token)
        if not announced:  # the orchestrator maps this process to its consumer ID
            led.write(HELLO, ctx.consumer_id, os.getpid())
            announced = True
        if event.slow_ms:
            await anyio.sleep(event.slow_ms / 1000)
        # written before returning: the entry is acked only after this line is in the file
        led.write(
            RAISED if event.poison else HANDLED,
            event.r,
            event.s,
            ctx.entry_id,
            ctx.fencing_token,
            ctx.shard,
            ctx.attempt,
            start,
            time.time_ns(),
            ctx.published_at_ms,
            ctx.event_id_bytes.hex(),
            fence,
        )
        if event.poison:
            raise PoisonEvent(f"{event.r}#{event.s} is poison")

    # Our own signal receiver rather than run(handle_signals=True): "ready" is written once
    # SIGTERM is caught, so the orchestrator never SIGTERMs a process that would just die of it.
    stop = anyio.Event()
    try:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            led.write(READY, os.getpid())
            async with anyio.create_task_group() as tg:

                async def on_signal() -> None:
                    async for _ in signals:
                        stop.set()

                tg.start_soon(on_signal)
                await bus.run(stop=stop)
                tg.cancel_scope.cancel()
    finally:
        await bus.aclose()
    led.write(EXITED, _peak_rss_kb())
    led.close()


async def publisher_role(cfg: dict[str, Any]) -> None:
    """One publisher process: one task per resource publishes its events in seq order (the next
    only after Redis acknowledged the previous), paced to the process's share of the rate."""
    led = LineWriter(Path(cfg["ledger"]), buffered=True)  # never killed: flushed periodically
    bus = EventBus(Settings(**cfg["settings"]))
    # Connected and imported: say so, then wait for the orchestrator's "go" line on stdin, so
    # that all publishers start together and the fault schedule starts with them.
    async with bus:
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        await _publish_all(bus, led, cfg)
    await bus.aclose()


async def _publish_all(bus: EventBus, led: LineWriter, cfg: dict[str, Any]) -> None:
    resources: list[str] = cfg["resources"]
    counts: list[int] = cfg["counts"]
    poison = {(r, s) for r, s in cfg["poison"]}
    slow = set(cfg["slow"])
    pad = "x" * cfg["pad"]
    duration = sum(counts) / cfg["rate"] if cfg["rate"] else 0.0
    start = time.monotonic()

    async def one(i: int, r: str, n: int) -> None:
        interval = duration / n if n else 0.0
        offset = interval * i / len(resources)  # spread the resources over the interval
        for s in range(1, n + 1):
            if interval:
                delay = start + offset + (s - 1) * interval - time.monotonic()
                if delay > 0:
                    await anyio.sleep(delay)
            flags = ("p" if (r, s) in poison else "") + ("s" if r in slow else "") or "-"
            event = Step(
                r=r,
                s=s,
                poison=(r, s) in poison,
                slow_ms=cfg["slow_ms"] if r in slow else 0.0,
                pad=pad,
            )
            try:
                entry_id = await bus.publish(TOPIC, event, resource_id=r)
            except PublishError as exc:  # not acknowledged: may or may not be stored
                led.write(PUBLISH_FAILED, r, s, "-", time.time_ns(), str(exc)[:200])
                continue
            led.write(PUBLISHED, r, s, entry_id, time.time_ns(), flags)

    async def flusher() -> None:
        while True:
            await anyio.sleep(0.2)
            led.flush()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(flusher)
            async with anyio.create_task_group() as work:
                for i, (r, n) in enumerate(zip(resources, counts, strict=True)):
                    work.start_soon(one, i, r, n)
            tg.cancel_scope.cancel()
    finally:
        led.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("_consumer", "_publisher"):
        role = consumer_role if sys.argv[1] == "_consumer" else publisher_role
        anyio.run(role, json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} _consumer|_publisher CONFIG_JSON")
