"""``eventbus dlq list|show|requeue|drop``: the dead letters and parked resources of a group
(`eventbus.dlq.DeadLetters`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import typer
from rich.table import Table

from eventbus.app import EventBus
from eventbus.cli.connection import RedisUrl, open_bus, settings_from, stored_shards
from eventbus.cli.output import cell, console, data_console, run_async, user_errors
from eventbus.cli.rendering import json_text
from eventbus.dlq import DeadLetter, DeadLetters
from eventbus.errors import ConfigError, EventBusError
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.replies import redacted

dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters of a consumer group.")

DlqIds = Annotated[list[str] | None, typer.Argument(help="Dead-letter IDs.")]


def _dlq_call(
    redis_url: str | None, topic: str, group: str, action: Callable[[DeadLetters], Awaitable[Any]]
) -> Any:
    """`action` on the dead letters of `group` on `topic` (a registered topic); an unknown
    group is an error (a typo would otherwise list nothing, as if nothing had failed)."""
    with user_errors():
        settings = settings_from(redis_url)

    async def go() -> Any:
        bus = await open_bus(settings)
        try:
            shards = await stored_shards(bus, topic)
            await _check_group(bus, topic, shards, group)
            return await action(
                DeadLetters(bus.redis, bus.keys, bus.topic(topic, shards=shards), group)
            )
        finally:
            await bus.aclose()

    return run_async(go)


async def _check_group(bus: EventBus, topic: str, shards: int, group: str) -> None:
    """Raise `ConfigError` unless `group` reads a shard stream of `topic`, has dead letters or
    parked resources (the group may be gone: its letters are still the operator's)."""
    keys = bus.keys  # (two calls: the keys are in different slots of a Cluster)
    if await bus.redis.exists(keys.dead_letter(topic, group)):
        return
    if await bus.redis.hgetall(keys.parked(topic, group)):  # (the operator's role reads it so)
        return
    pipe = bus.redis.pipeline(transaction=False)
    for s in range(shards):
        pipe.xinfo_groups(bus.keys.stream(topic, s))
    groups = set()
    for reply in await pipe.execute(raise_on_error=False):
        if isinstance(reply, list):  # (an error: the shard stream does not exist yet)
            groups |= {g["name"].decode("utf-8", "replace") for g in reply}
    if group not in groups:
        known = ", ".join(sorted(groups)) or "none"
        raise ConfigError(f"no consumer group {group!r} on topic {topic!r} (its groups: {known})")


@dlq_app.command("list")
def dlq_list(
    topic: str,
    group: str,
    count: Annotated[int, typer.Option(min=1, help="Most entries to show.")] = 50,
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
    data_console().print(table)
    if parked:
        data_console().print(f"parked resources: {', '.join(cell(p) for p in sorted(parked))}")


def _error_text(d: DeadLetter) -> str:
    if d.problems:
        return "malformed: " + "; ".join(d.problems)
    # (a parked letter has no error type: "resource is parked", not ": resource is parked")
    return f"{d.error_type}: {d.error}" if d.error_type else d.error


@dlq_app.command("show")
def dlq_show(topic: str, group: str, dlq_id: str, redis_url: RedisUrl = None) -> None:
    """One dead letter in full, with its decoded event and the handler's traceback, as JSON."""

    async def action(dl: DeadLetters) -> DeadLetter | None:
        return await dl.get(dlq_id)

    d = _dlq_call(redis_url, topic, group, action)
    if d is None:
        console.print(f"[red]error:[/red] no dead letter {cell(dlq_id)}")
        raise typer.Exit(1)
    out: dict[str, Any] = {
        f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "fields"
    }
    out["traceback"] = d.traceback.splitlines()  # one JSON string per line: readable as printed
    try:
        env = decode_entry(d.original())
        out["event"] = {
            "event_id": str(env.event_id),
            "published_at_ms": env.published_at_ms,
            "headers": redacted(env.headers),  # no secret on a terminal
            "payload": env.payload,
        }
    except EventBusError as exc:
        out["event"] = {"undecodable": str(exc)}
    print(json_text(out, indent=2))  # ASCII: control characters are escaped


def _ids_or_resource_command(
    name: str,
    by_ids: Callable[[DeadLetters, list[str]], Awaitable[Any]],
    by_resource: Callable[[DeadLetters, str], Awaitable[Any]],
    *,
    resource_help: str,
    help: str,
) -> None:
    """Add ``eventbus dlq NAME TOPIC GROUP [DLQ_IDS]... [--resource R]``: it prints what
    `by_resource` returns for R, or what `by_ids` returns for the IDs; neither or both is a
    one-line error (exit code 1)."""

    def command(
        topic: str,
        group: str,
        dlq_ids: DlqIds = None,
        # typer.Option as the default, not in Annotated: annotations are strings here, and
        # resource_help is this call's
        resource: str | None = typer.Option(None, help=resource_help),
        redis_url: RedisUrl = None,
    ) -> None:
        with user_errors():  # (neither did nothing, both ignored the IDs)
            if resource is not None and dlq_ids:
                raise ConfigError(f"dlq {name}: give dead-letter IDs or --resource, not both")
            if resource is None and not dlq_ids:
                raise ConfigError(f"dlq {name}: give dead-letter IDs or --resource R")

        async def action(dl: DeadLetters) -> Any:
            if resource is not None:
                return await by_resource(dl, resource)
            return await by_ids(dl, dlq_ids or [])

        print(_dlq_call(redis_url, topic, group, action))

    dlq_app.command(name, help=help)(command)


_ids_or_resource_command(
    "requeue",
    DeadLetters.requeue,
    DeadLetters.requeue_resource,
    resource_help="Requeue a parked resource.",
    help="Put dead letters back in their shard streams, or replay and unpark a parked resource.",
)
_ids_or_resource_command(
    "drop",
    DeadLetters.drop,
    DeadLetters.drop_resource,
    resource_help="Drop a parked resource's events.",
    help="Delete dead letters for good, or discard a parked resource's events and unpark it.",
)
