"""`eventbus.testing.running` outside the pytest plugin: what the block raises is raised as itself,
not wrapped in an `ExceptionGroup` by the task group that runs the subscribers."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from eventbus import EventBus
from eventbus.testing import running

pytestmark = pytest.mark.anyio


class Ping(BaseModel):
    n: int


def _bus() -> EventBus:
    bus = EventBus()

    @bus.subscriber("pings", group="g")
    async def handle(event: Ping) -> None:
        pass

    return bus


async def test_an_assertion_in_the_block_is_raised_as_itself() -> None:
    with pytest.raises(AssertionError, match="the test's own check"):
        async with running(_bus()) as tb:
            await tb.bus.publish("pings", Ping(n=1), resource_id="a")
            await tb.drain()
            raise AssertionError("the test's own check")


async def test_an_error_in_the_block_keeps_its_type_and_cause() -> None:
    with pytest.raises(KeyError) as caught:
        async with running(_bus()):
            try:
                {}["missing"]
            except KeyError as exc:
                raise KeyError("looked up") from exc
    assert isinstance(caught.value.__cause__, KeyError)


async def test_the_block_ends_normally_without_an_error() -> None:
    async with running(_bus()) as tb:
        await tb.bus.publish("pings", Ping(n=1), resource_id="a")
        await tb.drain()
    assert [h.event for h in tb.handled] == [Ping(n=1)]
