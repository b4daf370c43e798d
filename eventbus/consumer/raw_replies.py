"""Raw RESP replies of reads, parsed here in the shapes redis-py's client returns: the blocking
reads on a Cluster (`cluster_reads`), on connections of their own outside the client's pool, and
a single node's read round (`reading.Reader.read`), packed with hiredis (`execute_packed`),
which skips redis-py's pipeline and its per-command reply callbacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)
"""Pack one command (a tuple of bytes) as RESP."""


def detached_connection(node: Any) -> Any:
    """A connection to `node` with the client's options, outside its pool, without retries (a
    re-sent XREADGROUP ``>`` would read past what the lost reply delivered)."""
    return node.connection_class(**{**node.connection_kwargs, "retry": Retry(NoBackoff(), 0)})


async def client_id(conn: Any) -> int:
    await conn.send_packed_command(pack((b"CLIENT", b"ID")))
    return int(await conn.read_response())


async def next_reply(conn: Any) -> Any:
    """The next reply on `conn`; an error reply is returned, not raised (the replies after it
    must still be read)."""
    try:
        return await conn.read_response()
    except ResponseError as exc:
        return exc


def delivered(reply: Any) -> bool:
    """Whether an XREADGROUP reply delivered entries (into this consumer's PEL)."""
    return not isinstance(reply, Exception) and any(rows for _, rows in parse_xread(reply))


def parse_xread(reply: Any) -> list[tuple[bytes, Any]]:
    """A raw ``XREADGROUP`` reply as redis-py's client returns it: ``[(stream, [(id, fields),
    ...]), ...]`` (fields None for an entry deleted while pending). Parsed here, not by redis-py's
    private helpers, whose shape changes between versions; RESP2 (array) or RESP3 (map)."""
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    return [(stream, [(row[0], fields_of(row[1])) for row in rows or []]) for stream, rows in pairs]


def fields_of(flat: Any) -> dict[bytes, bytes] | None:
    """An entry's fields from its flat RESP2 list ``[name, value, ...]`` (or a RESP3 map);
    None for an entry deleted while pending. Raises ValueError for a list of odd length.
    Per entry read: an entry of eventbus's three fields is built as a dict display (a
    ``dict(zip(...[::2], ...[1::2], strict=True))`` cost ~2,600 instructions per entry, the
    ``strict`` keyword's parsing alone ~1,000)."""
    if flat is None:
        return None
    if type(flat) is list and len(flat) == 6:  # rid, type, data: every entry eventbus writes
        return {flat[0]: flat[1], flat[2]: flat[3], flat[4]: flat[5]}
    if isinstance(flat, dict):
        return dict(flat)
    if len(flat) % 2:
        raise ValueError(f"an entry's field list has an odd length ({len(flat)})")
    pairs = iter(flat)
    return dict(zip(pairs, pairs, strict=True))


def parse_xpending(reply: Any) -> dict[str, Any]:
    """A raw ``XPENDING <stream> <group>`` summary: pending, min, max, consumers (name,
    pending) as redis-py's client returns it (a reply it parsed already is returned as is:
    `execute_packed` runs through redis-py's pipeline on a Cluster and fakeredis)."""
    if isinstance(reply, dict):
        return reply
    return {
        "pending": reply[0],
        "min": reply[1],
        "max": reply[2],
        "consumers": [{"name": n, "pending": int(p)} for n, p in reply[3] or []],
    }


def name_of(stream: bytes | str) -> str:
    """A stream name as text."""
    return stream.decode() if isinstance(stream, bytes) else stream


def strays(summaries: list[Any], me: bytes) -> dict[int, list[bytes]]:
    """By index in `summaries` (``XPENDING`` summary replies, raw or as redis-py parses them),
    the names of the consumers other than `me` with entries pending; only the indexes that have
    some. A raw summary with nothing pending, or only `me`'s, costs two tests."""
    found: dict[int, list[bytes]] = {}
    for i, reply in enumerate(summaries):
        if type(reply) is list:  # raw: [count, min, max, [[name, count], ...]]
            if not reply[0] or (len(reply[3]) == 1 and reply[3][0][0] == me):
                continue
            names = [name for name, n in reply[3] if name != me and int(n)]
        else:
            names = others_of(parse_xpending(reply), me)
        if names:
            found[i] = names
    return found


def others_of(summary: Any, me: bytes) -> list[bytes]:
    """The consumers other than `me` with entries pending in an ``XPENDING`` summary
    (`raw_replies.parse_xpending`'s shape)."""
    return [c["name"] for c in summary.get("consumers") or [] if c["name"] != me and c["pending"]]
