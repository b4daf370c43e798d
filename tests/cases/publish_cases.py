"""Publishing, as test cases run on fakeredis and on a real redis-server (`cases.backends`).

`publish()` on a bus whose `run()` is starting (the run started in a task, the
publish made at once on the same bus, not entered with ``async with``) hung for ever: the call
took its place while no flusher ran, and awaited the flusher once one had started. It must be
sent, whatever the shard count.
"""

from __future__ import annotations

from functools import partial

import anyio
import pytest
from cases.backends import Backend
from support import Recorder, Tick

from eventbus import Context


class PublishCases:
    @pytest.mark.anyio
    @pytest.mark.parametrize("shards", [1, 16])
    async def test_publish_while_the_run_starts(self, backend: Backend, shards: int) -> None:
        bus = backend.bus(shards=shards)
        rec = Recorder()

        @bus.subscriber("orders", group="g")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        stop = anyio.Event()
        entry_ids: list[str] = []

        async def publish(resource: str) -> None:
            tick = Tick(resource=resource, seq=0)
            entry_ids.append(await bus.publish("orders", tick, resource_id=resource))

        async def publish_many() -> None:
            events = [(f"m{i}", Tick(resource=f"m{i}", seq=0)) for i in range(3)]
            entry_ids.extend(await bus.publish_many("orders", events))

        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(bus.run, stop=stop))
            with anyio.fail_after(10):  # it hung for ever
                async with anyio.create_task_group() as calls:  # all made before the run starts
                    for resource in ("a", "b"):
                        calls.start_soon(publish, resource)
                    calls.start_soon(publish_many)
            assert len(entry_ids) == 5
            await rec.wait_for(5)
            stop.set()
        await bus.aclose()
        assert sorted(h.resource for h in rec.log) == ["a", "b", "m0", "m1", "m2"]
