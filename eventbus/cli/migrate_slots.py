"""``eventbus topic migrate-slots TOPIC --to topic|shared``: move a stopped topic's coordination
keys to the other layout of `eventbus.protocol.keys` (setting ``coordination_slots``).

The two layouts name different keys, so members of one never see the other's locks: a topic
changes layout only stopped (docs/operations.md, "Changing the coordination slots"). The command

1. finds the topic's groups from the keys of both layouts (``SCAN``) and the offloader's;
2. refuses (`LiveMembers`, nothing written) while a member of either layout is live (members
   sorted set, deadline after the server's time);
3. per group, sets every fencing token of the target layout to max(source, target), so a token
   handed out after the move is above every token handed out before it (fencing); adds the
   parked and control entries the target lacks; deletes the target's lock epoch (the next lock
   round starts a new era, so no member trusts a scan of the old keys); moves the offloader's
   checkpoints, per shard the further one;
4. marks the source layout moved: its members set holds `MOVED` with an infinite deadline, and
   it owns every shard lock there, so a member still running the old layout (a process not
   stopped, an old release) takes no shard instead of a second owner's; then deletes the source's
   parked, control and checkpoint hashes (moved). A later move back clears the mark.

Every step keeps what an earlier, interrupted run wrote (max, add-if-absent), so the command
may run again. ``--dry-run`` reports the plan and the refusal without writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import typer

from eventbus.cli.connection import RedisUrl, open_bus, settings_from, stored_shards
from eventbus.cli.output import cell, data_console, run_async, user_errors
from eventbus.config import Settings
from eventbus.errors import ConfigError
from eventbus.protocol.ids import parse_id
from eventbus.protocol.keys import CoordinationSlots, Keys, check_name
from eventbus.tier.settings import OFFLOADER_GROUP

MOVED = "eventbus:moved-to-other-slots"
"""The member that holds a moved layout's locks forever (a ``:`` no consumer ID can have)."""

_TOKEN = ":token"


class LiveMembers(ConfigError):
    """Members of the topic are live (`live`: ``(layout, group) -> member IDs``): the stated
    stop has not happened yet, and the command wrote nothing."""

    def __init__(self, topic: str, live: dict[tuple[str, str], list[str]]) -> None:
        shown = "; ".join(f"{s} layout, group {g}: {', '.join(m)}" for (s, g), m in live.items())
        super().__init__(
            f"topic {topic!r}: live members ({shown}); stop every consumer and offloader of the "
            "topic (or wait for their liveness TTL) and run again"
        )
        self.live = live


@dataclass
class GroupMove:
    """What a move does to one group: its tokens (shard -> max(source, target)), and the
    parked and control entries it adds to the target."""

    tokens: dict[str, int] = field(default_factory=dict)
    parked: int = 0
    control: int = 0


@dataclass
class Plan:
    """The move of `topic` from `source` to `target` (`groups`: name -> `GroupMove`;
    `checkpoints`: shards whose checkpoint fields the target takes from the source)."""

    topic: str
    shards: int
    source: Keys
    target: Keys
    groups: dict[str, GroupMove]
    checkpoints: dict[int, dict[str, bytes]]
    live: dict[tuple[str, str], list[str]]


def _layout_keys(keys: Keys, slots: CoordinationSlots) -> Keys:
    return Keys(keys.prefix, keys.hashtag, slots)


async def _groups(redis: Any, keys: Keys, topic: str) -> set[str]:
    """The groups of `topic` with a members, locks, epoch, parked or control key in `keys`'
    layout (key names: ``<start>:<family>:<topic>:<group>``, ``...:locks:epoch:<topic>:<group>``;
    names hold no ``:``)."""
    start = keys.members(topic, "_").removesuffix(f":members:{topic}:_")
    found = set()
    async for raw in redis.scan_iter(match=f"{start}:*:{topic}:*", count=1000):
        rest = (raw.decode() if isinstance(raw, bytes) else raw)[len(start) + 1 :].split(":")
        if len(rest) == 3 and rest[0] in ("locks", "members", "parked", "control"):
            found.add(rest[2])
        elif len(rest) == 4 and rest[:2] == ["locks", "epoch"]:
            found.add(rest[3])
    return found


async def _server_ms(redis: Any, key: str) -> int:
    """The time (Unix ms) of the server holding `key`: liveness deadlines are in its clock."""
    if hasattr(redis, "get_node_from_key"):  # a Cluster: ask that key's primary
        secs, micros = await redis.execute_command(
            "TIME", target_nodes=redis.get_node_from_key(key)
        )
    else:
        secs, micros = await redis.time()
    return int(secs) * 1000 + int(micros) // 1000


async def _live(
    redis: Any, keys: Keys, topic: str, groups: set[str]
) -> dict[tuple[str, str], list[str]]:
    """The live members (but `MOVED`) of `groups` in `keys`' layout, by (layout, group)."""
    now_ms = await _server_ms(redis, keys.members(topic, "_"))  # (one slot per layout and topic)
    live: dict[tuple[str, str], list[str]] = {}
    for g in sorted(groups):
        ids = await redis.zrangebyscore(keys.members(topic, g), f"({now_ms}", "+inf")
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        if ids := [i for i in ids if i != MOVED]:
            live[(keys.slots, g)] = ids
    return live


def _str_map(raw: dict[Any, bytes]) -> dict[str, bytes]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}


def _checkpoint_rank(fields: dict[str, bytes], shard: int) -> tuple[int, int]:
    """Shard `shard`'s checkpoint in `fields` as (ms, seq), (0, 0) for none; `ConfigError`
    naming the value when it is no entry ID."""
    cp = fields.get(str(shard))
    if cp is None:
        return (0, 0)
    entry = parse_id(cp)
    return (entry.ms, entry.seq)


async def _checkpoints(
    redis: Any, plan_keys: tuple[Keys, Keys], topic: str, shards: int
) -> dict[int, dict[str, bytes]]:
    """Per shard, the source's checkpoint fields (``<shard>``, ``<shard>:pending``, ...) where
    the target has none of that shard or an earlier checkpoint."""
    source, target = plan_keys
    src = _str_map(await redis.hgetall(source.checkpoints(topic)))
    dst = _str_map(await redis.hgetall(target.checkpoints(topic)))
    moves = {}
    for s in range(shards):
        mine = {k: v for k, v in src.items() if k.split(":")[0] == str(s)}
        theirs = {k: v for k, v in dst.items() if k.split(":")[0] == str(s)}
        if mine and (not theirs or _checkpoint_rank(mine, s) > _checkpoint_rank(theirs, s)):
            moves[s] = mine
    return moves


async def plan(redis: Any, keys: Keys, topic: str, shards: int, to: CoordinationSlots) -> Plan:
    """What moving `topic` (`shards` shards) to layout `to` does, read without writing: groups,
    tokens, entries, checkpoints and live members (`Plan.live`; `move` refuses unless empty)."""
    check_name("topic", topic)
    target = _layout_keys(keys, to)
    source = _layout_keys(keys, "shared" if to == "topic" else "topic")
    groups = await _groups(redis, source, topic) | await _groups(redis, target, topic)
    groups.add(OFFLOADER_GROUP)
    live = await _live(redis, source, topic, groups)
    live |= await _live(redis, target, topic, groups)
    moves = {}
    for g in sorted(groups):
        src_locks = _str_map(await redis.hgetall(source.locks(topic, g)))
        dst_locks = _str_map(await redis.hgetall(target.locks(topic, g)))
        move = GroupMove()
        for f, v in src_locks.items():
            if f.endswith(_TOKEN):
                move.tokens[f] = max(int(v), int(dst_locks.get(f, 0)))
        for family in ("parked", "control"):
            src = _str_map(await redis.hgetall(getattr(source, family)(topic, g)))
            dst = await redis.hgetall(getattr(target, family)(topic, g))
            dst_fields = set(_str_map(dst))
            setattr(move, family, len(set(src) - dst_fields))
        moves[g] = move
    checkpoints = await _checkpoints(redis, (source, target), topic, shards)
    return Plan(topic, shards, source, target, moves, checkpoints, live)


async def move(redis: Any, p: Plan) -> None:
    """Carry out plan `p` (module docstring, steps 3 and 4). Raises `LiveMembers` when `p`
    found live members, or when one of the source layout appeared while it ran (then the
    target is written but the source is not marked moved: stop that member, run again)."""
    if p.live:
        raise LiveMembers(p.topic, p.live)
    src, dst, topic = p.source, p.target, p.topic
    for g, gm in p.groups.items():
        await _clear_mark(redis, dst, topic, g)
        if gm.tokens:
            await redis.hset(dst.locks(topic, g), mapping=gm.tokens)
        for family in ("parked", "control"):
            entries = await redis.hgetall(getattr(src, family)(topic, g))
            for k, v in entries.items():
                await redis.hsetnx(getattr(dst, family)(topic, g), k, v)
        await redis.delete(dst.lock_epoch(topic, g))  # a new era of epochs
    if p.checkpoints:
        fields = [f for shard in p.checkpoints for f in _shard_fields(shard)]
        await redis.hdel(dst.checkpoints(topic), *fields)
        mapping = {k: v for moved in p.checkpoints.values() for k, v in moved.items()}
        await redis.hset(dst.checkpoints(topic), mapping=mapping)
    late = await _live(redis, src, topic, set(p.groups))
    if late:
        raise LiveMembers(topic, late)
    for g in p.groups:
        await redis.zadd(src.members(topic, g), {MOVED: "+inf"})
        await redis.hset(src.locks(topic, g), mapping={str(s): MOVED for s in range(p.shards)})
        await redis.delete(src.parked(topic, g), src.control(topic, g))  # (one slot)
    await redis.delete(src.checkpoints(topic))


def _shard_fields(shard: int) -> list[str]:
    return [str(shard), *(f"{shard}:{k}" for k in ("pending", "count", "gap"))]


async def _clear_mark(redis: Any, keys: Keys, topic: str, group: str) -> None:
    """Undo an earlier move away from `keys`' layout: drop `MOVED` from the members set and
    from every lock it owns (their tokens stay: fencing)."""
    await redis.zrem(keys.members(topic, group), MOVED)
    locks = _str_map(await redis.hgetall(keys.locks(topic, group)))
    if owned := [f for f, v in locks.items() if v in (MOVED, MOVED.encode())]:
        await redis.hdel(keys.locks(topic, group), *owned)


def describe(p: Plan, *, done: bool) -> str:
    """The plan (or what was done) in words, one line per group."""
    verb = "moved" if done else "would move"
    lines = [
        f"topic {p.topic}: {p.source.slots} -> {p.target.slots} layout "
        f"({p.source.topic_hashtag(p.topic)} -> {p.target.topic_hashtag(p.topic)}): {verb}"
    ]
    for g, gm in sorted(p.groups.items()):
        top = max(gm.tokens.values(), default=0)
        lines.append(
            f"  group {g}: {len(gm.tokens)} fencing tokens (highest {top}), "
            f"{gm.parked} parked, {gm.control} control entries"
        )
    lines.append(f"  checkpoints of {len(p.checkpoints)} shards; lock epochs start a new era")
    if p.live:
        lines.append(f"  REFUSED: {LiveMembers(p.topic, p.live)}")
    return "\n".join(lines)


def migrate_slots(
    topic: str,
    to: Annotated[
        Literal["topic", "shared"],
        typer.Option(help="The layout to move TOPIC's coordination keys to."),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report the plan and any refusal; write nothing.")
    ] = False,
    redis_url: RedisUrl = None,
) -> None:
    """Move TOPIC's locks, fencing tokens, parked and control entries and checkpoints to the
    other coordination_slots layout, with every consumer and offloader of TOPIC stopped
    (refuses while one is live). Then start them with EVENTBUS_COORDINATION_SLOTS=<to>."""
    with user_errors():
        settings = settings_from(redis_url)
    run_async(_migrate, settings, topic, to, dry_run)


async def _migrate(settings: Settings, topic: str, to: CoordinationSlots, dry_run: bool) -> None:
    bus = await open_bus(settings)
    try:
        shards = await stored_shards(bus, topic)
        p = await plan(bus.redis, bus.keys, topic, shards, to)
        if dry_run:
            data_console().print(cell(describe(p, done=False)), soft_wrap=True)
            if p.live:
                raise typer.Exit(1)
            return
        await move(bus.redis, p)
        data_console().print(cell(describe(p, done=True)), soft_wrap=True)
    finally:
        await bus.aclose()
