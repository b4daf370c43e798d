"""Failure policies through the CLI against a real redis-server. The policies themselves
(continue, park, requeue/drop, dedup, retries, validators) are shared cases run on fakeredis and
on redis-server: `tests/cases/failure_policy_cases.py`."""

from __future__ import annotations

import pytest
from cases.failure_policy_cases import letters_are, publish
from support import Tick, async_client, running, wait_until
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.dlq import DeadLetters

pytestmark = pytest.mark.anyio


def test_dlq_cli_lists_and_requeues_a_parked_resource(redis_db: str) -> None:
    import anyio

    async def setup() -> None:
        bus = EventBus(Settings(redis_url=redis_db, shards=2, max_attempts=1))

        @bus.subscriber("orders", group="billing", on_failure="park")
        async def handle(event: Tick) -> None:
            raise RuntimeError("always")

        async with bus:
            await publish(bus, "bad", range(1, 3))
        client = async_client(redis_db)
        dl = DeadLetters(client, bus.keys, bus.topic("orders"), "billing")
        async with running(bus):
            await wait_until(lambda: letters_are(dl, 2))
        await client.aclose()

    anyio.run(setup)
    runner = CliRunner(env={"COLUMNS": "250"})
    listed = runner.invoke(app, ["dlq", "list", "orders", "billing", "--redis-url", redis_db])
    assert listed.exit_code == 0, listed.output
    assert "parked resources: bad" in listed.output and "RuntimeError" in listed.output
    requeued = runner.invoke(
        app, ["dlq", "requeue", "orders", "billing", "--resource", "bad", "--redis-url", redis_db]
    )
    assert requeued.exit_code == 0, requeued.output
    refused = runner.invoke(
        app, ["dlq", "requeue", "orders", "billing", "--resource", "nope", "--redis-url", redis_db]
    )
    assert refused.exit_code == 1 and "is not parked" in refused.output


def test_dlq_cli_drops_a_parked_resource_not_its_letters_one_by_one(redis_db: str) -> None:
    """``dlq drop`` by dead-letter IDs refuses a parked resource's letters (dropping some of
    them would replay the rest out of order); ``dlq drop --resource`` has the group's consumer
    delete them all and unpark the resource."""
    import anyio

    bus = EventBus(Settings(redis_url=redis_db, shards=2, max_attempts=1))

    @bus.subscriber("orders", group="billing", on_failure="park")
    async def handle(event: Tick) -> None:
        raise RuntimeError("always")

    async def park() -> list[str]:
        async with bus:
            await publish(bus, "bad", range(1, 4))
        async with running(bus), async_client(redis_db) as client:
            dl = DeadLetters(client, bus.keys, bus.topic("orders"), "billing")
            await wait_until(lambda: letters_are(dl, 3))
            return [d.dlq_id for d in await dl.letters()]

    ids = anyio.run(park)
    runner = CliRunner(env={"COLUMNS": "250"})
    url = ["--redis-url", redis_db]
    one = runner.invoke(app, ["dlq", "drop", "orders", "billing", ids[0], *url])
    assert one.exit_code == 1 and "belong to a parked resource" in one.output
    dropped = runner.invoke(app, ["dlq", "drop", "orders", "billing", "--resource", "bad", *url])
    assert dropped.exit_code == 0, dropped.output

    async def executed() -> None:
        async with running(bus), async_client(redis_db) as client:
            dl = DeadLetters(client, bus.keys, bus.topic("orders"), "billing")

            async def done() -> bool:
                return await letters_are(dl, 0) and not await dl.parked()

            await wait_until(done)

    anyio.run(executed)
