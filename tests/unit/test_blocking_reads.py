"""`eventbus.testing.blocking_reads`: on the in-memory Redis a blocking ``XREADGROUP`` with
``COUNT`` waits for an entry, as Redis does (fakeredis 2.40 answered it at once, empty), answers
at once what it can answer, and ``CLIENT UNBLOCK`` ends it empty."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from eventbus.testing import memory_redis

pytestmark = pytest.mark.anyio


async def _read(r: Any, streams: dict[str, str], got: list[Any], block: int) -> None:
    got.append(await r.xreadgroup("g", "c", streams, count=10, block=block))


async def test_a_read_with_count_waits_for_the_entry_added_after_it() -> None:
    r = memory_redis()
    await r.xgroup_create("s", "g", id="0", mkstream=True)
    got: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_read, r, {"s": ">"}, got, 0)  # BLOCK 0: until an entry comes
        await anyio.wait_all_tasks_blocked()
        assert got == []  # still waiting: nothing was there to read
        entry_id = await r.xadd("s", {"n": "1"})

    [[[stream, [(read_id, fields)]]]] = got
    assert (stream, read_id, fields) == (b"s", entry_id, {b"n": b"1"})


async def test_a_read_with_something_to_answer_answers_at_once() -> None:
    r = memory_redis()
    await r.xgroup_create("s", "g", id="0", mkstream=True)
    entry_id = await r.xadd("s", {"n": "1"})

    new = await r.xreadgroup("g", "c", {"s": ">"}, count=10, block=0)
    pending = await r.xreadgroup("g", "c", {"s": "0"}, count=10, block=0)  # its own PEL

    assert new[0][1][0][0] == entry_id
    assert pending[0][1][0][0] == entry_id


async def test_client_unblock_ends_a_waiting_read_empty() -> None:
    r = memory_redis()
    await r.xgroup_create("s", "g", id="0", mkstream=True)
    got: list[Any] = []
    with anyio.fail_after(10):  # (a hang guard: without the unblock the read waits for ever)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_read, r, {"s": ">"}, got, 0)
            await anyio.wait_all_tasks_blocked()
            unblocked = [await r.client_unblock(int(c["id"])) for c in await r.client_list()]

    assert sum(unblocked) == 1
    assert got == [[]]
