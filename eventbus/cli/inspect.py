"""``eventbus stats`` and ``eventbus tail``: read-only views of topics, groups and entries."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from redis.exceptions import ResponseError
from rich.table import Table

from eventbus.cli.connection import RedisUrl, open_bus, settings_from, stored_shards
from eventbus.cli.output import cell, data_console, run_async, user_errors
from eventbus.cli.placement import placement_table
from eventbus.cli.rendering import json_text
from eventbus.client.pipelines import execute
from eventbus.config import Settings
from eventbus.consumer.supervision import refused
from eventbus.errors import EventBusError, RedisCommandRefused
from eventbus.protocol.codec import F_DATA, decode_entry
from eventbus.protocol.dictionaries import Dictionaries
from eventbus.protocol.replies import redacted


def stats(redis_url: RedisUrl = None) -> None:
    """Topics, shard streams, consumer groups (lag, pending, live consumers, locked shards)."""
    with user_errors():
        settings = settings_from(redis_url)
    run_async(_stats, settings)


def _no_stream(reply: object) -> bool:
    """Whether an XINFO reply is Redis's "no such key" (a shard stream not created yet)."""
    return isinstance(reply, ResponseError) and "no such key" in str(reply).lower()


async def _stats(settings: Settings) -> None:
    bus = await open_bus(settings)
    r, keys = bus.redis, bus.keys
    try:
        with refused("HGETALL", keys.topics()):
            topics = await bus.registry.stored()
        table = Table(
            "topic",
            "shards",
            "entries",
            "B/entry",
            "group",
            "lag",
            "pending",
            "live",
            "locked",
            "trimmed",
        )
        for topic, shards in sorted(topics.items()):
            streams = [keys.stream(topic, s) for s in range(shards)]
            pipe = r.pipeline(transaction=False)
            for st in streams:
                pipe.xinfo_stream(st)
                pipe.xinfo_groups(st)
            replies = await pipe.execute(raise_on_error=False)
            entries = 0
            groups: dict[str, list[int]] = {}  # group -> [lag, pending, estimated, unknown]
            for st, info, infos in zip(streams, replies[0::2], replies[1::2], strict=True):
                for command, reply in (("XINFO STREAM", info), ("XINFO GROUPS", infos)):
                    if isinstance(reply, Exception) and not _no_stream(reply):
                        raise RedisCommandRefused(command, st, f"{type(reply).__name__}: {reply}")
                if not isinstance(info, dict) or not isinstance(infos, list):
                    continue  # the shard stream does not exist yet
                entries += info["length"]
                for g in infos:
                    agg = groups.setdefault(g["name"].decode("utf-8", "replace"), [0, 0, 0, 0])
                    # Redis's lag is exact only while it knows the group's entries-read (after
                    # an AOF reload it estimates), and null when it cannot tell (an entry deleted
                    # after the group's last-delivered ID): unknown then, not 0. A group that
                    # has delivered the stream's last ID has no lag, whatever Redis says.
                    if g["last-delivered-id"] != info["last-generated-id"]:
                        if g.get("lag") is None:
                            agg[3] = 1
                        else:
                            agg[0] += g["lag"]
                            agg[2] |= g.get("entries-read") is None
                    agg[1] += g["pending"]
            per_entry = await bytes_per_entry(r, streams, entries)
            table.add_row(cell(topic), str(shards), str(entries), per_entry, *[""] * 6)
            with refused("TIME", "(no key)"):
                secs, micros = await r.time()  # liveness deadlines are in Redis server time
            now_ms = secs * 1000 + micros // 1000
            for g, (lag, pending, estimated, unknown) in sorted(groups.items()):
                with refused("ZCOUNT", keys.members(topic, g)):
                    live = await r.zcount(keys.members(topic, g), now_ms, "+inf")
                with refused("HGETALL", keys.locks(topic, g)):
                    locks = await r.hgetall(keys.locks(topic, g))
                held = sum(1 for k in locks if k.isdigit())
                with refused("XRANGE", keys.trimmed(topic, g)):
                    records = await r.xrange(keys.trimmed(topic, g))
                # unread entries lost to MAXLEN (eventbus.consumer.trims)
                trimmed = sum(int(f.get(b"count", 0)) for _, f in records)
                table.add_row(
                    "",
                    "",
                    "",
                    "",
                    cell(g),
                    lag_cell(lag, estimated=bool(estimated), unknown=bool(unknown)),
                    str(pending),
                    str(live),
                    f"{held}/{shards}",
                    str(trimmed),
                )
        data_console().print(table)
        if (placed := await placement_table(r, keys, topics)) is not None:  # on a Cluster
            data_console().print(placed)
    finally:
        await bus.aclose()


def lag_cell(lag: int, *, estimated: bool, unknown: bool) -> str:
    """The stats table's lag of a group: `lag` entries summed over the shard streams whose lag
    Redis knows; ``~`` when part of it is Redis's estimate; with `unknown` (Redis's lag was null
    for a stream) ``?`` alone, or ``>=`` before the known part, a lower bound."""
    shown = f"~{lag}" if estimated else str(lag)
    if not unknown:
        return shown
    return f">={shown}" if lag else "?"


async def bytes_per_entry(r: Any, streams: list[str], entries: int) -> str:
    """Redis memory per entry of a topic's shard streams (``MEMORY USAGE``, all samples), as
    text; "-" for an empty topic. Raises `RedisCommandRefused` (naming the streams and the
    server's reason) when Redis answers an error, e.g. NOPERM under an ACL."""
    if not entries:
        return "-"
    pipe = r.pipeline(transaction=False)
    for st in streams:
        pipe.memory_usage(st, samples=0)
    with refused("MEMORY USAGE", ",".join(streams)):
        used = sum(n or 0 for n in await execute(pipe))
    return f"{used / entries:.0f}"


def tail(
    topic: str,
    count: Annotated[int, typer.Option(min=1, help="Entries to show per shard.")] = 5,
    redis_url: RedisUrl = None,
) -> None:
    """Print the newest entries of each shard of TOPIC, decoded, as JSON lines."""
    with user_errors():
        settings = settings_from(redis_url)
    run_async(_tail, settings, topic, count)


async def _tail(settings: Settings, topic: str, count: int) -> None:
    bus = await open_bus(settings)
    dictionaries = Dictionaries(bus.redis, bus.keys)
    try:
        for shard in range(await stored_shards(bus, topic)):
            stream = bus.keys.stream(topic, shard)
            with refused("XREVRANGE", stream):
                rows = await bus.redis.xrevrange(stream, count=count)
            for entry_id, fields in reversed(rows):
                out: dict[str, Any] = {"shard": shard, "entry_id": entry_id.decode()}
                try:
                    await dictionaries.ensure(topic, fields.get(F_DATA, b""))
                    env = decode_entry(fields, max_bytes=settings.max_decompressed_bytes)
                    out |= {
                        "resource_id": env.resource_id,
                        "type": env.event_type,
                        "event_id": str(env.event_id),
                        "published_at_ms": env.published_at_ms,
                        "headers": redacted(env.headers),  # no secret on a terminal
                        "payload": env.payload,
                    }
                except EventBusError as exc:
                    out["error"] = str(exc)
                print(json_text(out))  # ASCII: control characters are escaped
    finally:
        await bus.aclose()
