"""`eventbus.publishing.wire.Wire.pipeline`: which slots a batch settles when some replies are
lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from eventbus.config import Settings
from eventbus.publishing.slots import Slot
from eventbus.publishing.wire import Wire

pytestmark = pytest.mark.anyio


class _Pipeline:
    def __init__(self, results: list[Any]) -> None:
        self.results = results

    def xadd(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return list(self.results)


class _Client:
    """Stands for a Cluster client whose pipeline got these per-command results (redis-py's
    cluster pipeline returns a node's lost connection as an exception per command)."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results

    def pipeline(self, transaction: bool = False) -> _Pipeline:
        return _Pipeline(self.results)


def _slots(streams: list[str]) -> list[Slot]:
    loop = asyncio.get_running_loop()
    return [Slot(loop.create_future(), stream=s, fields={b"d": b"x"}, maxlen=100) for s in streams]


async def test_a_lost_node_leaves_only_its_streams_slots_for_resending() -> None:
    lost = RedisConnectionError("node B gone")
    batch = _slots(["A", "B", "A", "B", "C"])
    wire = Wire(_Client([b"1-0", lost, b"2-0", lost, b"3-0"]), Settings())

    with pytest.raises(RedisConnectionError):
        await wire.pipeline(batch)

    assert [s.future.done() for s in batch] == [True, False, True, False, True]
    assert [batch[i].future.result() for i in (0, 2, 4)] == ["1-0", "2-0", "3-0"]


async def test_a_streams_slots_after_its_lost_reply_are_resent_even_if_confirmed() -> None:
    """Settling B's second slot while its first goes round again would put B's entries out of
    call order (the first would land after the second)."""
    batch = _slots(["B", "B"])
    wire = Wire(_Client([RedisConnectionError("lost"), b"5-0"]), Settings())

    with pytest.raises(RedisConnectionError):
        await wire.pipeline(batch)

    assert [s.future.done() for s in batch] == [False, False]


class _Conn:
    """A redis-py connection as `Wire.read` sees it: redis-py's own RESP2 hiredis parser, its
    reader fed `buffered` bytes; `read_response` (counted) feeds the next of `later` first, as
    if it had read them from the socket, then parses one reply like redis-py's."""

    protocol = 2

    def __init__(self, buffered: bytes, later: list[bytes]) -> None:
        from types import SimpleNamespace

        from redis._parsers.hiredis import _AsyncHiredisParser

        self._parser = _AsyncHiredisParser(65536)
        self._parser.on_connect(  # type: ignore[arg-type]
            SimpleNamespace(_reader=None, encoder=SimpleNamespace(decode_responses=False))
        )
        self.reader: Any = self._parser._reader
        self.reader.feed(buffered)
        self.later = later
        self.calls = 0

    async def read_response(self) -> Any:
        self.calls += 1
        reply = self.reader.gets()
        while reply is _not_enough():
            self.reader.feed(self.later.pop(0))
            reply = self.reader.gets()
        if isinstance(reply, Exception):
            raise reply
        return reply


def _not_enough() -> Any:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA

    return NOT_ENOUGH_DATA


async def test_read_takes_buffered_replies_without_a_read_response_each() -> None:
    """Replies already in the connection's buffer are parsed straight from its reader: no
    ``read_response`` coroutine pair per reply (the publisher's CPU per event)."""
    batch = _slots(["A", "B", "C"])
    conn = _Conn(b"$3\r\n1-0\r\n-ERR no such key\r\n$3\r\n2-0\r\n", [])

    await Wire(None, Settings()).read(conn, batch)

    assert conn.calls == 0
    assert [batch[i].future.result() for i in (0, 2)] == ["1-0", "2-0"]
    assert "no such key" in str(batch[1].future.exception())


async def test_read_waits_for_replies_not_buffered_yet_in_order() -> None:
    batch = _slots(["A", "B", "C", "D"])
    conn = _Conn(b"$3\r\n1-0\r\n$3\r", [b"\n2-0\r\n-ERR refused\r\n", b"$3\r\n3-0\r\n"])

    await Wire(None, Settings()).read(conn, batch)

    assert conn.calls == 2  # the two replies that were not whole in the buffer
    assert [batch[i].future.result() for i in (0, 1, 3)] == ["1-0", "2-0", "3-0"]
    assert "refused" in str(batch[2].future.exception())


def _entries(loop: asyncio.AbstractEventLoop) -> list[Slot]:
    """Common XADDs on 3 streams (one non-ASCII) and 2 caps, empty and large values, and one
    entry with other fields."""
    slots = [
        Slot(
            loop.create_future(),
            stream=f"P:stream:t{'é' if i % 3 == 2 else ''}:{i % 3}",
            fields={b"rid": b"r%d" % i, b"type": "tÿpe".encode(), b"data": b"\x01" + b"x" * i},
            maxlen=100 if i % 2 else 7,
        )
        for i in range(0, 3000, 30)
    ]
    slots[5].fields = {b"rid": b"", b"type": b"T", b"data": b""}
    slots.append(Slot(loop.create_future(), stream="s", fields={b"k": b"v"}, maxlen=1))
    return slots


async def test_pack_writes_what_hiredis_packs_command_by_command() -> None:
    import hiredis

    from eventbus.publishing.wire import _xadd

    batch = _entries(asyncio.get_running_loop())
    wire = Wire(None, Settings(publish_replicas=1, publish_replicas_timeout_ms=250))

    want = b"".join(hiredis.pack_command(_xadd(s)) for s in batch)  # type: ignore[arg-type]
    want += hiredis.pack_command((b"WAIT", 1, 250))  # type: ignore[arg-type]
    assert wire.pack(batch) == want
    assert wire.pack(batch) == want  # with the prefixes remembered


async def test_pack_calls_hiredis_once_per_stream_and_cap_not_per_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hiredis's ``pack_command`` took ~10x the time of one ``%`` for an XADD's 12 arguments:
    the common XADD is formatted from a prefix packed once per (stream, cap)."""
    import hiredis

    calls: list[tuple[Any, ...]] = []
    real = hiredis.pack_command

    def counted(args: tuple[Any, ...]) -> bytes:
        calls.append(args)
        return real(args)  # type: ignore[arg-type]

    monkeypatch.setattr(hiredis, "pack_command", counted)
    batch = _entries(asyncio.get_running_loop())
    wire = Wire(None, Settings())

    wire.pack(batch)
    wire.pack(batch)

    # 3 streams x 2 caps at most, then once for the entry with other fields per pack
    assert len(calls) <= 6 + 2
    assert len(batch) == 101
