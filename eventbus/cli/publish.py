"""``eventbus publish``: publish one event with a JSON payload."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from eventbus.cli.connection import RedisUrl, open_bus, settings_from
from eventbus.cli.output import run_async, user_errors
from eventbus.errors import ConfigError
from eventbus.protocol.codec import Envelope, new_event_id


def publish(
    topic: str,
    event_type: Annotated[str, typer.Option("--type", help="Event type name.")],
    resource_id: Annotated[str, typer.Option(help="Resource ID (chooses the shard).")],
    data: Annotated[str, typer.Option(help="Payload as JSON, not validated.")] = "{}",
    redis_url: RedisUrl = None,
) -> None:
    """Publish one event with a JSON payload; prints its entry ID."""
    with user_errors():
        try:
            payload = json.loads(data)
        except ValueError as exc:
            raise ConfigError(f"--data is not valid JSON ({exc})") from None
        settings = settings_from(redis_url)
    env = Envelope(
        resource_id, event_type, new_event_id(), time.time_ns() // 1_000_000, {}, payload
    )

    async def go() -> str:
        bus = await open_bus(settings)
        try:
            shards = (await bus.registry.stored()).get(topic)
            return await bus.publisher.publish_envelope(bus.topic(topic, shards=shards), env)
        finally:
            await bus.aclose()

    print(run_async(go))
