"""The ``eventbus`` command (typer + rich).

``run`` runs a service's subscribers; ``stats``, ``tail``, ``publish`` and ``dlq`` are operator
tools; ``offload`` and ``replay`` drive the durable tier. Every command reads the same settings
as the library (``EVENTBUS_*``, ``REDIS_URL``), with ``--redis-url`` as an override.

What reaches the terminal is made safe: errors are one line with exit code 1 (no traceback),
passwords are redacted, and user data (resource IDs, group names, error texts) has its control
characters escaped and, in tables, its rich markup escaped (`terminal_safe`, `cell`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, TypeVar

import anyio
import typer
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from eventbus.app import EventBus
from eventbus.codec import Envelope, decode_entry, new_event_id
from eventbus.config import Settings, scrub
from eventbus.dlq import DeadLetter, DeadLetters
from eventbus.errors import (
    ConfigError,
    EventBusError,
    RedisCommandRefused,
    RedisUnavailable,
)

T = TypeVar("T")
# Errors a user can act on: printed as one line, exit code 1
_USER_ERRORS = (EventBusError, RedisError, OSError, ValidationError)

app = typer.Typer(no_args_is_help=True, help="Event-driven microservices on Redis Streams.")
console = Console(stderr=True)

RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Overrides REDIS_URL / EVENTBUS_REDIS_URL.")
]

# C0 and C1 controls (ESC, CR, BS, ...) except tab and newline, line separators, bidi overrides
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# URLs seen by this process (settings, --redis-url): their secrets are scrubbed from output
_URLS: set[str] = set()


def terminal_safe(text: object, *, newlines: bool = False) -> str:
    """`text` as it may reach a terminal: control characters (escape sequences, carriage
    returns, bidi overrides) shown as ``\\xNN`` escapes, newlines and tabs too unless
    `newlines`, and every known Redis password replaced by ``***``."""
    out = str(text)
    for url in _URLS:
        out = scrub(out, url)
    if not newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", out)


def cell(text: object) -> str:
    """User data (a resource ID, a group name, an error) as a rich table cell or markup
    fragment: `terminal_safe`, with rich markup escaped."""
    return escape(terminal_safe(text))


def settings_from(redis_url: str | None) -> Settings:
    """The settings (environment, `redis_url` overriding); raises `ValidationError`."""
    if redis_url:
        _URLS.add(redis_url)
    for name in ("EVENTBUS_REDIS_URL", "REDIS_URL"):
        if os.environ.get(name):
            _URLS.add(os.environ[name])
    settings = Settings(redis_url=redis_url) if redis_url else Settings()
    _URLS.add(settings.redis_url)
    return settings


class _TerminalLogFilter(logging.Filter):
    """Makes log records safe for a terminal: passwords scrubbed, control characters escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = terminal_safe(record.getMessage(), newlines=True)
        record.args = ()
        return True


def _logging(level: str) -> None:
    handler = RichHandler(console=console)
    handler.addFilter(_TerminalLogFilter())
    logging.basicConfig(level=level.upper(), format="%(message)s", handlers=[handler])


def _message(exc: BaseException) -> str:
    """One line describing `exc`, safe for a terminal."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"]) or "settings"
            parts.append(f"{where}: {err['msg']}")
        text = "invalid settings: " + "; ".join(parts)
    elif isinstance(exc, EventBusError):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return terminal_safe(text)


def _fail(exc: BaseException) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(_message(exc))}", soft_wrap=True)
    return typer.Exit(1)


def _leaf(exc: BaseException) -> BaseException | None:
    """The user error inside `exc` (itself, or the first one inside an exception group whose
    other members are only cancellations), or None."""
    if isinstance(exc, _USER_ERRORS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(_USER_ERRORS)
        if match is not None and rest is None:
            return _leaf(match.exceptions[0])
    return None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Errors a user can act on (bad settings or arguments, Redis unreachable or refusing,
    a shard-count mismatch, ...) become one line on stderr and exit code 1, not a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except BaseException as exc:
        leaf = _leaf(exc)
        if leaf is None:
            raise
        raise _fail(leaf) from None


def _run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`anyio.run` under `user_errors`."""
    with user_errors():
        return anyio.run(fn, *args)


async def open_bus(settings: Settings) -> EventBus:
    """An `EventBus` whose Redis answered a PING; raises `RedisUnavailable` (URL redacted)
    when it cannot be reached, refuses the credentials or does not answer in time."""
    bus = EventBus(settings)
    try:
        await bus.redis.ping()
    except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError) as exc:
        await bus.aclose()
        raise RedisUnavailable.of(settings, exc) from None
    return bus


def load_bus(target: str) -> EventBus:
    """Import ``module:attribute`` and return the `EventBus` it names; raises `ConfigError`
    (one line) when the module, the attribute or the bus is not there."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"expected module:attribute (e.g. app:bus), got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(
                f"{target}: no module named {exc.name!r} (run from the folder that holds it)"
            ) from None
        raise
    bus = getattr(module, attr, None)
    if not isinstance(bus, EventBus):
        found = "nothing" if bus is None else type(bus).__name__
        raise ConfigError(f"{target} is not an EventBus (found {found})")
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
    with user_errors():
        bus = load_bus(target)
        _URLS.add(bus.settings.redis_url)
        if metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(metrics_port, addr="127.0.0.1")
    _run_async(lambda: bus.run(handle_signals=True))


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
    if any(codes):  # a child killed by a signal has a negative code
        raise typer.Exit(1)


@app.command()
def stats(redis_url: RedisUrl = None) -> None:
    """Topics, shard streams, consumer groups (lag, pending, live consumers, locked shards)."""
    with user_errors():
        settings = settings_from(redis_url)
    _run_async(_stats, settings)


def _no_stream(reply: object) -> bool:
    """Whether an XINFO reply is Redis's "no such key" (a shard stream not created yet)."""
    return isinstance(reply, ResponseError) and "no such key" in str(reply).lower()


async def _stats(settings: Settings) -> None:
    bus = await open_bus(settings)
    r, keys = bus.redis, bus.keys
    try:
        topics = await bus.registry.stored()
        table = Table("topic", "shards", "entries", "group", "lag", "pending", "live", "locked")
        for topic, shards in sorted(topics.items()):
            streams = [keys.stream(topic, s) for s in range(shards)]
            pipe = r.pipeline(transaction=False)
            for st in streams:
                pipe.xinfo_stream(st)
                pipe.xinfo_groups(st)
            replies = await pipe.execute(raise_on_error=False)
            entries = 0
            groups: dict[str, list[int]] = {}  # group -> [lag, pending, estimated]
            for st, info, infos in zip(streams, replies[0::2], replies[1::2], strict=True):
                for command, reply in (("XINFO STREAM", info), ("XINFO GROUPS", infos)):
                    if isinstance(reply, Exception) and not _no_stream(reply):
                        raise RedisCommandRefused(command, st, f"{type(reply).__name__}: {reply}")
                if not isinstance(info, dict) or not isinstance(infos, list):
                    continue  # the shard stream does not exist yet
                entries += info["length"]
                for g in infos:
                    agg = groups.setdefault(g["name"].decode("utf-8", "replace"), [0, 0, 0])
                    # Redis's lag is exact only while it knows the group's entries-read (after
                    # an AOF reload it estimates): a group that has delivered the stream's last
                    # ID has no lag, whatever the estimate says.
                    if g["last-delivered-id"] != info["last-generated-id"]:
                        agg[0] += g.get("lag") or 0
                        agg[2] |= g.get("entries-read") is None
                    agg[1] += g["pending"]
            table.add_row(cell(topic), str(shards), str(entries), "", "", "", "", "")
            secs, micros = await r.time()  # liveness deadlines are in Redis server time
            now_ms = secs * 1000 + micros // 1000
            for g, (lag, pending, estimated) in sorted(groups.items()):
                live = await r.zcount(keys.members(topic, g), now_ms, "+inf")
                locks = await r.hgetall(keys.locks(topic, g))
                held = sum(1 for k in locks if k.isdigit())
                shown = f"~{lag}" if estimated else str(lag)
                table.add_row(
                    "", "", "", cell(g), shown, str(pending), str(live), f"{held}/{shards}"
                )
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
    with user_errors():
        settings = settings_from(redis_url)
    _run_async(_tail, settings, topic, count)


async def _tail(settings: Settings, topic: str, count: int) -> None:
    bus = await open_bus(settings)
    try:
        shards = (await bus.registry.stored()).get(topic)
        if shards is None:
            raise ConfigError(f"unknown topic {topic!r}")
        for shard in range(shards):
            rows = await bus.redis.xrevrange(bus.keys.stream(topic, shard), count=count)
            for entry_id, fields in reversed(rows):
                out: dict[str, Any] = {"shard": shard, "entry_id": entry_id.decode()}
                try:
                    env = decode_entry(fields, max_bytes=settings.max_decompressed_bytes)
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
                print(json.dumps(out, default=str))  # ASCII: control characters are escaped
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
    with user_errors():
        try:
            payload = json.loads(data)
        except ValueError as exc:
            raise ConfigError(f"--data is not valid JSON ({exc})") from None
        settings = settings_from(redis_url)
    env = Envelope(
        resource_id, event_type, new_event_id(), time.time_ns() // 1_000_000, {}, payload
    )

    async def go() -> str:
        bus = await open_bus(settings)
        try:
            shards = (await bus.registry.stored()).get(topic)
            return await bus.publisher.publish_envelope(bus.topic(topic, shards=shards), env)
        finally:
            await bus.aclose()

    print(_run_async(go))


dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters of a consumer group.")
app.add_typer(dlq_app, name="dlq")


def _dead_letters(bus: EventBus, topic: str, shards: int | None, group: str) -> DeadLetters:
    if shards is None:
        raise ConfigError(f"unknown topic {topic!r}")
    return DeadLetters(bus.redis, bus.keys, bus.topic(topic, shards=shards), group)


def _dlq_call(redis_url: str | None, topic: str, group: str, action: Any) -> Any:
    with user_errors():
        settings = settings_from(redis_url)

    async def go() -> Any:
        bus = await open_bus(settings)
        try:
            shards = (await bus.registry.stored()).get(topic)
            return await action(_dead_letters(bus, topic, shards, group))
        finally:
            await bus.aclose()

    return _run_async(go)


@dlq_app.command("list")
def dlq_list(
    topic: str,
    group: str,
    count: Annotated[int, typer.Option(help="Most entries to show.")] = 50,
    redis_url: RedisUrl = None,
) -> None:
    """Dead letters of GROUP on TOPIC, oldest first, and the parked resources."""

    async def action(dl: DeadLetters) -> tuple[list[DeadLetter], dict[str, str]]:
        return await dl.letters(count), await dl.parked()

    letters, parked = _dlq_call(redis_url, topic, group, action)
    table = Table("dlq id", "shard", "entry id", "resource", "type", "reason", "attempts", "error")
    for d in letters:
        table.add_row(
            cell(d.dlq_id),
            str(d.shard),
            cell(d.entry_id),
            cell(d.resource_id or ""),
            cell(d.event_type or ""),
            cell(d.reason),
            str(d.attempts),
            cell(_error_text(d)[:80]),
        )
    Console().print(table)
    if parked:
        Console().print(f"parked resources: {', '.join(cell(p) for p in sorted(parked))}")


def _error_text(d: DeadLetter) -> str:
    if d.problems:
        return "malformed: " + "; ".join(d.problems)
    return f"{d.error_type}: {d.error}"


@dlq_app.command("show")
def dlq_show(topic: str, group: str, dlq_id: str, redis_url: RedisUrl = None) -> None:
    """One dead letter in full, with its decoded event, as JSON."""

    async def action(dl: DeadLetters) -> DeadLetter | None:
        return await dl.get(dlq_id)

    d = _dlq_call(redis_url, topic, group, action)
    if d is None:
        console.print(f"[red]error:[/red] no dead letter {cell(dlq_id)}")
        raise typer.Exit(1)
    out: dict[str, Any] = {
        f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "fields"
    }
    try:
        env = decode_entry(d.original())
        out["event"] = {
            "event_id": str(env.event_uuid),
            "time_ms": env.time_ms,
            "headers": env.headers,
            "payload": env.payload,
        }
    except EventBusError as exc:
        out["event"] = {"undecodable": str(exc)}
    print(json.dumps(out, indent=2, default=str))  # ASCII: control characters are escaped


@dlq_app.command("requeue")
def dlq_requeue(
    topic: str,
    group: str,
    dlq_ids: Annotated[list[str] | None, typer.Argument(help="Dead-letter IDs.")] = None,
    resource: Annotated[str | None, typer.Option(help="Requeue a parked resource.")] = None,
    redis_url: RedisUrl = None,
) -> None:
    """Put dead letters back in their shard streams, or replay and unpark a parked resource."""

    async def action(dl: DeadLetters) -> Any:
        if resource is not None:
            return await dl.requeue_resource(resource)
        return await dl.requeue(dlq_ids or [])

    print(_dlq_call(redis_url, topic, group, action))


@dlq_app.command("drop")
def dlq_drop(
    topic: str,
    group: str,
    dlq_ids: Annotated[list[str] | None, typer.Argument(help="Dead-letter IDs.")] = None,
    resource: Annotated[str | None, typer.Option(help="Drop a parked resource's events.")] = None,
    redis_url: RedisUrl = None,
) -> None:
    """Delete dead letters for good, or discard a parked resource's events and unpark it."""

    async def action(dl: DeadLetters) -> Any:
        if resource is not None:
            return await dl.drop_resource(resource)
        return await dl.drop(dlq_ids or [])

    print(_dlq_call(redis_url, topic, group, action))


def _register_optional() -> None:
    """Commands living in modules with optional dependencies (the durable tier), registered when
    importable."""
    try:
        mod = importlib.import_module("eventbus.tier.cli")
    except ImportError:
        return
    mod.register(app)


_register_optional()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
