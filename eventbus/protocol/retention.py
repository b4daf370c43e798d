"""Retention: how long Redis keeps a topic's entries.

* ``"maxlen"`` (the default): each shard stream is capped with ``XADD ... MAXLEN ~ maxlen``.
  Entries a consumer group has not read yet can be trimmed; consumers detect and report it
  (`eventbus.consumer.trims`), and the durable tier archives before it trims.
* ``"acked"``: Redis keeps every entry until every consumer group of the topic has acked it (and,
  when the durable tier runs, the offloader has archived it). Consumers trim their shards with
  ``XTRIM MINID ~`` to that point (`trim_to_acked`), every `trim_check_s`; the offloader never
  trims past it. ``MAXLEN`` stays as the hard memory cap: entries it trims unread raise the trim
  alarm (``eventbus_trimmed_unread_total``). The trade-off: a stopped or slow group holds its
  backlog in Redis memory, up to the cap, instead of losing it.

The point a group still needs is its oldest pending entry, or the entry after its last-delivered
ID when nothing is pending (``XINFO GROUPS`` + ``XPENDING`` summary). A group created later than
the trim starts after it; an operator who moves a group back (``XGROUP SETID``) finds only what
was kept.
"""

from __future__ import annotations

from typing import Any, Literal

from eventbus.client.pipelines import execute
from eventbus.protocol.ids import EntryId, parse_id

Retention = Literal["maxlen", "acked"]
RETENTIONS: tuple[Retention, ...] = ("maxlen", "acked")


async def acked_point(redis: Any, stream: str) -> EntryId | None:
    """The lowest entry ID some consumer group of `stream` still needs (entries below it are
    acked by every group), or None when the stream has no group (or no stream)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except Exception as exc:  # no such key: nothing to keep or trim
        if "no such key" in str(exc).lower():
            return None
        raise
    if not groups:
        return None
    pipe = redis.pipeline(transaction=False)
    for g in groups:
        pipe.xpending(stream, g["name"])
    points = []
    for g, summary in zip(groups, await execute(pipe), strict=True):
        if summary["pending"]:
            points.append(parse_id(summary["min"]))
        else:
            points.append(parse_id(g["last-delivered-id"]).next())
    return min(points)


async def trim_to_acked(
    redis: Any, stream: str, *, checkpoint: EntryId | None, exact: bool = False
) -> EntryId | None:
    """``XTRIM <stream> MINID [~] <point>`` where `point` is `acked_point`, lowered to just
    after `checkpoint` (the offloader's, when the durable tier archives the topic). Returns the
    point trimmed to, or None when nothing may be trimmed. `exact` trims precisely (costs more
    CPU in Redis; ``~`` removes whole macro nodes only)."""
    point = await acked_point(redis, stream)
    if point is None:
        return None
    if checkpoint is not None:
        point = min(point, checkpoint.next())
    await redis.xtrim(stream, minid=str(point), approximate=not exact)
    return point


async def trim_held_to_acked(
    redis: Any,
    checkpoints_key: str,
    streams: dict[int, str],
    *,
    archived: bool = False,
    exact: bool = False,
    offloader_locks: str | None = None,
) -> None:
    """`trim_to_acked` for the shard `streams` (shard -> stream key) a consumer holds, each
    bounded by its offloader checkpoint in `checkpoints_key`. A topic the durable tier archives
    (`archived`, or any checkpoint recorded) keeps every entry of a shard with no checkpoint
    yet: the offloader has archived nothing of it. So does a shard an offloader has ever locked
    (a ``<shard>:token`` field in `offloader_locks`, the offloader group's locks hash: tokens
    are never deleted): an offloader that ran while the topic was empty recorded no checkpoint,
    and the entries acked before its next round were trimmed unarchived (a recorded gap)."""
    checkpoints = await redis.hgetall(checkpoints_key)
    archived = archived or bool(checkpoints)
    for shard, stream in streams.items():
        raw = checkpoints.get(str(shard).encode())
        if raw is None and archived:
            continue
        no_checkpoint = raw is None and offloader_locks is not None
        if no_checkpoint and await redis.hget(offloader_locks, f"{shard}:token") is not None:
            continue
        checkpoint = parse_id(raw) if raw else None
        await trim_to_acked(redis, stream, checkpoint=checkpoint, exact=exact)
