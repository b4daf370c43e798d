"""A consumer process for the takeover tests: ``python consumer_proc.py '<json config>'``.

It runs one bus (with SIGTERM/SIGINT handling) subscribed to `topic` for `group`, and records to
Redis, as JSON lines:

* ``<prefix>:started`` - every handler call as it begins;
* ``<prefix>:handled`` - every handler call that returned;
* ``<prefix>:stopping`` - set once SIGTERM/SIGINT asked the bus to stop.

Events with ``seq >= block_from`` block their handler until the key ``<prefix>:gate`` exists
(never, unless the test creates it), so the process keeps entries pending on purpose. Events with
``seq < hold_below`` take ``hold_s`` seconds (a long handler, with no Redis call meanwhile).
"""

from __future__ import annotations

import json
import sys
import time

import anyio
from support import Tick, wait_until

from eventbus import Context, EventBus, Settings


def record(ctx: Context, event: Tick) -> str:
    return json.dumps(
        {
            "consumer": ctx.consumer_id,
            "resource": event.resource,
            "seq": event.seq,
            "entry_id": ctx.entry_id,
            "shard": ctx.shard,
            "token": ctx.fencing_token,
            "t": time.time(),
        }
    )


async def main(config: dict[str, object]) -> None:
    prefix = str(config["prefix"])
    block_from = int(config["block_from"])  # type: ignore[call-overload]
    hold_below = int(config.get("hold_below", 0))  # type: ignore[call-overload]
    hold_s = float(config.get("hold_s", 0))  # type: ignore[arg-type]
    bus = EventBus(Settings(**config["settings"]))  # type: ignore[arg-type]

    @bus.subscriber(str(config["topic"]), group=str(config["group"]))
    async def handle(event: Tick, ctx: Context) -> None:
        redis = bus.redis
        await redis.rpush(f"{prefix}:started", record(ctx, event))
        if event.seq < hold_below:
            await anyio.sleep(hold_s)
        if event.seq >= block_from:
            await wait_until(lambda: redis.exists(f"{prefix}:gate"), within_s=3600)
        await redis.rpush(f"{prefix}:handled", record(ctx, event))

    async def mark_stopping() -> None:
        await stop.wait()
        await bus.redis.set(f"{prefix}:stopping", 1)

    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(mark_stopping)
            await bus.run(stop=stop, handle_signals=True)
    finally:
        await bus.aclose()


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]))
