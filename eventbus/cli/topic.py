"""``eventbus topic``: per-topic settings stored in Redis. ``train-dict`` trains a zstd
dictionary for a topic's entries (`eventbus.protocol.dictionaries`); ``migrate-slots`` moves a
stopped topic's coordination keys to the other layout (`eventbus.cli.migrate_slots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eventbus.app import EventBus
from eventbus.cli.connection import RedisUrl, open_bus, settings_from, stored_shards
from eventbus.cli.migrate_slots import migrate_slots
from eventbus.cli.output import run_async, user_errors
from eventbus.config import Settings
from eventbus.errors import ConfigError, DecodeError
from eventbus.protocol.codec import F_DATA, decode_entry, dictionary_body
from eventbus.protocol.dictionaries import DEFAULT_SIZE, Dictionaries

topic_app = typer.Typer(no_args_is_help=True, help="Per-topic settings stored in Redis.")
topic_app.command("migrate-slots")(migrate_slots)


@topic_app.command("train-dict")
def train_dict(
    topic: str,
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Sample files instead of the topic: one MessagePack map each, as a "
            "dictionary compresses it (docs/protocol.md)."
        ),
    ] = None,
    sample: Annotated[
        int, typer.Option(min=1, help="Newest entries to sample, over all shards.")
    ] = 5000,
    size: Annotated[
        int, typer.Option(min=256, max=1 << 30, help="Dictionary size in bytes.")
    ] = DEFAULT_SIZE,
    redis_url: RedisUrl = None,
) -> None:
    """Train a zstd dictionary for TOPIC from a sample of its entries (or FILES) and make it
    the topic's current one: new entries use it, older ones stay readable."""
    with user_errors():
        settings = settings_from(redis_url)
        samples = [f.read_bytes() for f in files or []]
    run_async(_train, settings, topic, samples, sample, size)


async def _train(
    settings: Settings, topic: str, samples: list[bytes], sample: int, size: int
) -> None:
    bus = await open_bus(settings)
    dictionaries = Dictionaries(bus.redis, bus.keys)
    try:
        if not samples:
            samples = await sample_bodies(bus, dictionaries, topic, sample, settings)
        if len(samples) < 10:
            raise ConfigError(f"topic {topic!r}: {len(samples)} samples, at least 10 needed")
        dict_id = await dictionaries.train(topic, samples, size)
        _, versions = await dictionaries.versions(topic)
        print(
            f"topic {topic}: dictionary {dict_id} ({versions[dict_id]} bytes, from "
            f"{len(samples)} samples) is current; stored versions {sorted(versions)}"
        )
    finally:
        await bus.aclose()


async def sample_bodies(
    bus: EventBus, dictionaries: Dictionaries, topic: str, sample: int, settings: Settings
) -> list[bytes]:
    """The bodies a dictionary compresses (`dictionary_body`) of up to `sample` newest entries
    of `topic`, spread over its shards (entries that do not decode are skipped)."""
    shards = await stored_shards(bus, topic)
    per_shard = max(1, sample // shards)
    bodies = []
    for shard in range(shards):
        rows = await bus.redis.xrevrange(bus.keys.stream(topic, shard), count=per_shard)
        for _, fields in rows:
            data = fields.get(F_DATA, b"")
            await dictionaries.ensure(topic, data)
            try:
                env = decode_entry(fields, max_bytes=settings.max_decompressed_bytes)
            except DecodeError:
                continue
            bodies.append(dictionary_body(env))
    return bodies
