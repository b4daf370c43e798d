"""Is a test bus drained? What `eventbus.testing.TestBus.drain` asks, in O(1) round trips.

A bus is drained when no consumer holds an entry in flight (known in process: `Consumer.in_flight`
counts entries from their read to their XACK) and, in Redis, every group of the bus has been
delivered its streams' last entries with none pending, and every broadcast reader's position is
its stream's last entry. The second half reads the state of every shard stream of every
subscription:

* in memory (fakeredis), straight from the fake server's data (`memory_streams`): no command at
  all. Through fakeredis's client each command costs ~30 µs, so 32 topics x 16 shards polled
  with XINFO took 40 ms a round (and 3 commands per stream one after another took seconds);
* on a real server, in one pipeline (XINFO STREAM and XINFO GROUPS per stream: one round trip
  whatever the number of topics and shards).

Redis is asked only once nothing is in flight in process, so a drain that waits for handlers
costs no command until they finished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from eventbus.locking.member import AsyncRedis


@dataclass(slots=True)
class StreamState:
    """One stream as the drain sees it: the last ID it gave (``None``: no such stream), its
    last entry's ID (differs once that entry was deleted; broadcast readers are at the last
    entry; read only for a stream with broadcast readers) and, per group,
    ``(last-delivered-id, pending count)``; IDs as ``(ms, seq)``."""

    last: tuple[int, int] | None
    last_entry: tuple[int, int] = (0, 0)
    groups: dict[str, tuple[tuple[int, int], int]] = field(default_factory=dict)


@dataclass(slots=True)
class Watch:
    """What to check on one stream: the groups that must have read and acked it all, and the
    broadcast readers' positions (each a callable giving the last entry ID read, or None)."""

    stream: str
    groups: list[str] = field(default_factory=list)
    positions: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)


def parse_id(entry_id: Any) -> tuple[int, int]:
    """``b"1700000000000-3"`` (or str) as ``(1700000000000, 3)``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def behind(watches: Iterable[Watch], states: dict[str, StreamState]) -> list[str]:
    """The streams of `watches` not drained in `states`, each as a reason (for the timeout's
    message): a group not created yet (its consumer is starting: the entries wait for it), one
    not delivered up to the last entry, one with entries pending, a broadcast reader behind."""
    out = []
    for w in watches:
        state = states.get(w.stream)
        if state is None or state.last is None:
            continue  # no stream: nothing was published there
        for group in w.groups:
            got = state.groups.get(group)
            if got is None or got[1] or got[0] < state.last:
                out.append(f"{w.stream} group {group}")
        for name, position in w.positions:
            read = position()
            if read is None or parse_id(read) < state.last_entry:
                out.append(f"{w.stream} broadcast {name}")
    return out


def memory_streams(redis: AsyncRedis) -> Callable[[Sequence[Watch]], dict[str, StreamState]] | None:
    """A reader of the watched streams' state straight from a fakeredis client's server (no
    command), or None when `redis` is not a fakeredis client (then the drain asks Redis, as on a
    real server). The reader raises `AttributeError` on a fakeredis whose stream model differs
    from 2.x's (`TestBus` then asks through commands)."""
    kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
    server = kwargs.get("server")
    if server is None or not hasattr(server, "dbs"):
        return None
    db = server.dbs[kwargs.get("db", 0)]

    encoded: dict[str, bytes] = {}  # stream and group names as the server keys them

    def name(text: str) -> bytes:
        got = encoded.get(text)
        if got is None:
            got = encoded[text] = text.encode()
        return got

    def read(watches: Sequence[Watch]) -> dict[str, StreamState]:
        out = {}
        for w in watches:
            item = db.get(name(w.stream))
            value = getattr(item, "value", None)
            if value is None:
                out[w.stream] = StreamState(None)
                continue
            # fakeredis's IDs are named tuples (ms, seq): compared as they are. `last_id` is
            # the last ID XADD gave, even if that entry was deleted since.
            state = out[w.stream] = StreamState(value.last_id)
            if w.positions:
                state.last_entry = parse_id(value.last_item_key())
            for group in w.groups:
                found = value.group_get(name(group))
                if found is not None:
                    state.groups[group] = (found.last_delivered_key, len(found.pel))
        return out

    return read


async def redis_streams(redis: AsyncRedis, watches: Sequence[Watch]) -> dict[str, StreamState]:
    """The streams' state from Redis in one pipeline: XINFO STREAM and XINFO GROUPS of each (a
    missing stream answers "no such key", read as no stream). Raises what Redis raises else."""
    streams = [w.stream for w in watches]
    pipe = redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_stream(stream)
        pipe.xinfo_groups(stream)
    replies = await pipe.execute(raise_on_error=False)
    out = {}
    for i, (w, stream) in enumerate(zip(watches, streams, strict=True)):
        info, groups = replies[2 * i], replies[2 * i + 1]
        if isinstance(info, ResponseError) and "no such key" in str(info).lower():
            out[stream] = StreamState(None)
            continue
        for reply in (info, groups):
            if isinstance(reply, Exception):
                raise reply
        last_entry = info.get("last-entry")
        out[stream] = StreamState(
            parse_id(info["last-generated-id"]),
            parse_id(last_entry[0]) if last_entry and w.positions else (0, 0),
            {
                g["name"].decode(): (parse_id(g["last-delivered-id"]), int(g["pending"]))
                for g in groups
            },
        )
    return out
