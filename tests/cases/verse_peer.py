"""A Python re-implementation, for tests only, of Verse's stream consumer (verse-redis
``Subscriber::Stream``, commit b37e874), to run beside eventbus's consumers in a mixed fleet,
and of its publisher's ``publish_resource_event`` (`publish_resource_event`, with Verse's
``find_partition`` and ``Message#pack``), to write the entries a Verse service writes.

Verse's loop, one iteration: lock every shard it can (its lock script: free locks and locks
whose owner has no liveness key; it releases all of them at the end of the iteration), read the
unsharded channel streams and the locked shard streams with one ``XREADGROUP ... COUNT 10 BLOCK
<min block> NOACK`` (no pending entries list: what it read is gone from the group), release the
shards that gave nothing, process the messages in stream order (an exception is logged and the
next message processed), wait the adaptive block time (x0.7 after a read that gave messages, /0.7
after one that did not, within 0.1..2 s), release every lock. A second task sets its liveness
key ``EX 30`` every 15 s. Nothing fences it: a paused peer that wakes up processes what it read.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgpack
from redis.exceptions import ResponseError

_HERE = Path(__file__).resolve().parent
SCRIPT_KEY = "VERSE:STREAM:SHARDLOCK"
LIVENESS = "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:"


def find_partition(key: str, partitions: int = 16) -> int:
    """Verse's ``EventManager#find_partition`` (its own loop, not eventbus's function)."""
    a = 0
    for e in key.encode("utf-8"):
        a = (e + a * 498_975_571 + 548_897_941) & 0xFFFFFFFF
    return a % partitions


def pack(content: Any, headers: dict[str, Any], reply_to: str | None = None) -> bytes:
    """Verse's ``Message#pack`` with a new ID (``SecureRandom.random_number(2 << 48)`` in
    base 36): zlib (default level) of MessagePack ``{i, c, h, r}``."""
    n, digits = secrets.randbelow(2 << 48), ""
    while True:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
        if not n:
            break
    body = {"i": digits, "c": content, "h": headers, "r": reply_to}
    return zlib.compress(msgpack.packb(body, use_bin_type=True))


async def publish_resource_event(
    redis: Any,
    resource_type: str,
    resource_id: str,
    event: str,
    payload: Any,
    *,
    headers: dict[str, Any] | None = None,
    partitions: int = 16,
    maxlen: int = 1_000_000,
) -> bytes | None:
    """Verse's ``EventManager#publish_resource_event``: ``XADD VERSE:STREAM:RESOURCE:<type>$<shard>
    NOMKSTREAM MAXLEN ~ <maxlen> * msg <packed>`` (headers ``{event:}.merge(headers)``; the
    resource ID is hashed, not sent), then ``PUBLISH VERSE:RESOURCE:<type>:<event>``. Returns the
    entry ID (None when the stream does not exist: Verse does not create it)."""
    shard = find_partition(resource_id, partitions)
    content = pack(payload, {"event": event, **(headers or {})})
    entry_id = await redis.xadd(
        f"VERSE:STREAM:RESOURCE:{resource_type}${shard}",
        {"msg": content},
        nomkstream=True,
        approximate=True,
        maxlen=maxlen,
    )
    await redis.publish(f"VERSE:RESOURCE:{resource_type}:{event}", content)
    return entry_id  # type: ignore[no-any-return]


def _to_i(text: str) -> int:
    """Ruby's ``String#to_i``: the leading decimal digits, 0 without any."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits] or 0)


@dataclass
class VerseMessage:
    """What Verse's ``Message.unpack`` makes of an entry (keys symbolized: here, str)."""

    id: str
    content: Any
    headers: dict[str, Any]
    reply_to: str | None
    channel: str
    stream: str
    entry_id: str

    @classmethod
    def unpack(cls, data: bytes, *, channel: str, stream: str, entry_id: str) -> VerseMessage:
        value = msgpack.unpackb(zlib.decompress(data), raw=False)
        return cls(value["i"], value["c"], value["h"] or {}, value["r"], channel, stream, entry_id)


@dataclass
class VersePeer:
    """One Verse consumer (service `group`, service ID `service_id`) of `channels`.

    `handle(message)` is called for each message, in the order Verse processes them. `stopped`
    ends the loop after the current iteration (Verse's ``stop``).
    """

    redis: Any
    group: str
    service_id: str
    channels: list[str]
    handle: Callable[[VerseMessage], Any]
    shards: int = 16
    max_messages: int = 10
    min_block_s: float = 0.1
    max_block_s: float = 2.0
    block_delta: float = 0.7
    liveness_ttl_s: int = 30
    stopped: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.block_s = self.min_block_s
        self._lock = self.redis.register_script((_HERE / "verse_peer_lock_shards.lua").read_text())
        self._unlock = self.redis.register_script(
            (_HERE / "verse_peer_unlock_shards.lua").read_text()
        )

    async def init_groups(self) -> None:
        """``XGROUP CREATE <stream> <group> $ MKSTREAM`` on each channel and its shard streams."""
        for channel in self.channels:
            for stream in [channel, *(f"{channel}${i}" for i in range(self.shards))]:
                try:
                    await self.redis.xgroup_create(stream, self.group, id="$", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def acquire_locks(self, channels: list[str]) -> list[Any]:
        return list(
            await self._lock(
                keys=[SCRIPT_KEY], args=[self.group, self.service_id, self.shards, *channels]
            )
        )

    async def release_locks(self, channel_and_flags: list[Any]) -> None:
        await self._unlock(
            keys=[SCRIPT_KEY],
            args=[self.group, self.service_id, self.shards, *channel_and_flags],
        )

    async def lock_channel_shards(self) -> list[str]:
        reply = await self.acquire_locks(self.channels)
        locked = []
        for channel, flag in zip(reply[::2], reply[1::2], strict=True):
            name = channel.decode() if isinstance(channel, bytes) else channel
            locked += [f"{name}${i}" for i in range(self.shards) if int(flag) & (1 << i)]
        return locked

    async def unlock_channel_shards(self) -> None:
        flags: list[Any] = []
        for channel in self.channels:
            flags += [channel, 0xFFFFFFFF]
        await self.release_locks(flags)

    async def unlock_empty_shards(self, message_streams: list[str]) -> None:
        keep: dict[str, int] = {}
        for stream in message_streams:
            channel, _, shard = stream.rpartition("$")
            keep[channel] = keep.get(channel, 0xFFFFFFFF) & ~(1 << _to_i(shard))
        await self.release_locks([x for pair in keep.items() for x in pair])

    async def read_stream(self, streams: list[str]) -> dict[str, list[Any]]:
        try:
            reply = await self.redis.xreadgroup(
                self.group,
                self.service_id,
                dict.fromkeys(streams, ">"),
                count=self.max_messages,
                block=max(1, int(self.min_block_s * 1000)),
                noack=True,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return {}
        return {(s.decode() if isinstance(s, bytes) else s): entries for s, entries in reply or ()}

    async def iteration(self) -> None:
        """One turn of Verse's ``run`` loop (the module docstring)."""
        try:
            sharded = await self.lock_channel_shards()
            output = await self.read_stream([*self.channels, *sharded])
            self.block_s = (
                max(self.block_delta * self.block_s, self.min_block_s)
                if output
                else min(self.block_s / self.block_delta, self.max_block_s)
            )
            if output:
                await self.unlock_empty_shards(list(output))
                for stream, entries in output.items():
                    channel = stream.rpartition("$")[0]  # "" for an unsharded stream, as Verse
                    for entry_id, fields in entries:
                        message = VerseMessage.unpack(
                            fields[b"msg"],
                            channel=channel,
                            stream=stream,
                            entry_id=entry_id.decode(),
                        )
                        await self._process(message)
            with anyio.move_on_after(self.block_s):
                await self.stopped.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self.unlock_channel_shards()

    async def _process(self, message: VerseMessage) -> None:
        try:
            result = self.handle(message)
            if hasattr(result, "__await__"):
                await result
        except Exception:  # Verse logs the error and goes on with the next message
            pass

    async def keep_alive(self) -> None:
        while not self.stopped.is_set():
            await self.redis.set(LIVENESS + self.service_id, 1, ex=self.liveness_ttl_s)
            with anyio.move_on_after(self.liveness_ttl_s / 2):
                await self.stopped.wait()

    async def run(self) -> None:
        """Verse's ``start``: groups, then the liveness and read loops until `stopped`."""
        await self.init_groups()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.keep_alive)
            while not self.stopped.is_set():
                await self.iteration()
