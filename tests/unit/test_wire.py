"""`eventbus.publishing.wire.Wire.pipeline`: which slots a batch settles when some replies are
lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from eventbus.config import Settings
from eventbus.publishing.sending import Slot
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
