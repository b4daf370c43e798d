"""The ``eventbus`` command (typer + rich).

``run`` runs a service's subscribers; ``stats``, ``tail`` and ``publish`` are operator tools;
``demo flights`` is the end-to-end flights pipeline; ``offload`` and ``replay`` drive the
durable tier. Every command reads the same settings as the library (``EVENTBUS_*``,
``REDIS_URL``), with ``--redis-url`` as an override.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Annotated, Any

import anyio
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from eventbus.app import EventBus
from eventbus.codec import Envelope, decode_entry, new_event_id
from eventbus.config import Settings
from eventbus.errors import EventBusError

app = typer.Typer(no_args_is_help=True, help="Event-driven microservices on Redis Streams.")
demo_app = typer.Typer(no_args_is_help=True, help="End-to-end demonstrations on real data.")
app.add_typer(demo_app, name="demo")
console = Console(stderr=True)

RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Overrides REDIS_URL / EVENTBUS_REDIS_URL.")
]


def settings_from(redis_url: str | None) -> Settings:
    return Settings(redis_url=redis_url) if redis_url else Settings()


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(message)s", handlers=[RichHandler(console=console)]
    )


def load_bus(target: str) -> EventBus:
    """Import ``module:attribute`` and return the `EventBus` it names."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise typer.BadParameter(f"expected module:attribute, got {target!r}")
    sys.path.insert(0, os.getcwd())
    bus = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(bus, EventBus):
        raise typer.BadParameter(f"{target} is not an EventBus")
    return bus


@app.command()
def run(
    target: Annotated[str, typer.Argument(help="module:attribute of the EventBus, e.g. app:bus")],
    processes: Annotated[int, typer.Option(min=1, help="Consumer processes to start.")] = 1,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port (first process).")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Run the subscribers of an EventBus until SIGTERM or SIGINT, then shut down gracefully."""
    if processes > 1:
        _run_processes(target, processes, metrics_port, log_level)
        return
    _logging(log_level)
    bus = load_bus(target)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1")
    try:
        anyio.run(lambda: bus.run(handle_signals=True))
    except EventBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


def _run_processes(target: str, n: int, metrics_port: int | None, log_level: str) -> None:
    """Start `n` single-process runs and forward SIGTERM/SIGINT to them."""
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "eventbus.cli", "run", target, "--log-level", log_level]
        if metrics_port is not None and i == 0:
            cmd += ["--metrics-port", str(metrics_port)]
        procs.append(subprocess.Popen(cmd))

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise typer.Exit(max(codes))


@app.command()
def stats(redis_url: RedisUrl = None) -> None:
    """Topics, shard streams, consumer groups (lag, pending, live consumers) and lock owners."""
    anyio.run(_stats, settings_from(redis_url))


async def _stats(settings: Settings) -> None:
    bus = EventBus(settings)
    r, keys = bus.redis, bus.keys
    try:
        topics = await bus.registry.stored()
        table = Table("topic", "shards", "entries", "group", "lag", "pending", "live", "locked")
        for topic, shards in sorted(topics.items()):
            streams = [keys.stream(topic, s) for s in range(shards)]
            pipe = r.pipeline(transaction=False)
            for st in streams:
                pipe.xlen(st)
                pipe.xinfo_groups(st)
            replies = await pipe.execute(raise_on_error=False)
            entries = sum(x for x in replies[0::2] if isinstance(x, int))
            groups: dict[str, list[int]] = {}
            for infos in replies[1::2]:
                for g in infos if isinstance(infos, list) else []:
                    agg = groups.setdefault(g["name"].decode(), [0, 0])
                    agg[0] += g.get("lag") or 0
                    agg[1] += g["pending"]
            table.add_row(topic, str(shards), str(entries), "", "", "", "", "")
            for g, (lag, pending) in sorted(groups.items()):
                live = await r.zcount(keys.members(topic, g), int(time.time() * 1000), "+inf")
                locks = await r.hgetall(keys.locks(topic, g))
                held = sum(1 for k in locks if not k.endswith(b":token"))
                table.add_row("", "", "", g, str(lag), str(pending), str(live), f"{held}/{shards}")
        Console().print(table)
    finally:
        await bus.aclose()


@app.command()
def tail(
    topic: str,
    count: Annotated[int, typer.Option(help="Entries to show per shard.")] = 5,
    redis_url: RedisUrl = None,
) -> None:
    """Print the newest entries of each shard of TOPIC, decoded, as JSON lines."""
    anyio.run(_tail, settings_from(redis_url), topic, count)


async def _tail(settings: Settings, topic: str, count: int) -> None:
    bus = EventBus(settings)
    try:
        shards = (await bus.registry.stored()).get(topic)
        if shards is None:
            raise typer.BadParameter(f"unknown topic {topic!r}")
        for shard in range(shards):
            rows = await bus.redis.xrevrange(bus.keys.stream(topic, shard), count=count)
            for entry_id, fields in reversed(rows):
                out: dict[str, Any] = {"shard": shard, "entry_id": entry_id.decode()}
                try:
                    env = decode_entry(fields)
                    out |= {
                        "resource_id": env.resource_id,
                        "type": env.event_type,
                        "event_id": str(env.event_uuid),
                        "time_ms": env.time_ms,
                        "headers": env.headers,
                        "payload": env.payload,
                    }
                except EventBusError as exc:
                    out["error"] = str(exc)
                print(json.dumps(out, default=str))
    finally:
        await bus.aclose()


@app.command()
def publish(
    topic: str,
    event_type: Annotated[str, typer.Option("--type", help="Event type name.")],
    resource_id: Annotated[str, typer.Option(help="Resource ID (chooses the shard).")],
    data: Annotated[str, typer.Option(help="Payload as a JSON object.")] = "{}",
    redis_url: RedisUrl = None,
) -> None:
    """Publish one event with a JSON payload; prints its entry ID."""
    payload = json.loads(data)
    env = Envelope(
        resource_id, event_type, new_event_id(), time.time_ns() // 1_000_000, {}, payload
    )

    async def go() -> str:
        bus = EventBus(settings_from(redis_url))
        try:
            shards = (await bus.registry.stored()).get(topic)
            return await bus.publisher.publish_envelope(bus.topic(topic, shards=shards), env)
        finally:
            await bus.aclose()

    try:
        print(anyio.run(go))
    except EventBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


def _register_optional() -> None:
    """Commands living in their own modules (demo, durable tier), registered when importable."""
    for module, name in (
        ("eventbus.demo.flights", "flights"),
        ("eventbus.tier.cli", None),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if name:
            demo_app.command(name)(mod.main)
        else:
            mod.register(app)


_register_optional()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
