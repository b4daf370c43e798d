"""``eventbus tail`` and ``eventbus dlq show`` print entries another client wrote, whatever they
hold: a payload nested 1,000 deep (json's encoder stops there with ``RecursionError``) or a map
keyed by bytes (``TypeError``) ended the command with a traceback, hiding the entries after it
(found by tests/unit/test_decoders_fuzz.py's ``cli-rendering`` property)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import msgpack
import zstandard
from pydantic import BaseModel
from support import sync_client
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.protocol.dead_letters import dead_letter_fields

RUNNER = CliRunner(env={"COLUMNS": "200"})


def _entry(payload: Any) -> dict[bytes, bytes]:
    """An entry of format 0x02 (zstd), whose body MessagePack still unpacks 1,000 deep."""
    body = {"v": 1, "id": bytes(16), "ts": 1, "h": {}, "p": payload}
    data = b"\x02" + zstandard.ZstdCompressor().compress(msgpack.packb(body, use_bin_type=True))
    return {b"rid": b"r", b"type": b"Tick", b"data": data}


def _deep(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


class Tick(BaseModel):
    n: int


async def _publish_one(url: str) -> str:
    """One event published by a bus: the topic is registered (one shard), as the commands need."""
    bus = EventBus(Settings(redis_url=url, shards=1))
    async with bus:
        entry_id: str = await bus.publish("orders", Tick(n=1), resource_id="r")
    return entry_id


def _deep_as_printed(payload: Any) -> bool:
    """Whether `payload` is how the commands print `_deep(1_000)`: the value itself where the
    interpreter's JSON encoder goes that deep with the row around it (3.12+: its C recursion
    limit is no longer the interpreter's 1,000, gh-91079), else the levels past
    `rendering.MAX_DEPTH` replaced by a note saying they are nested deeper."""
    return bool(payload == _deep(1_000)) or "nested deeper than" in json.dumps(payload)


def test_tail_and_dlq_show_print_deep_and_bytes_keyed_payloads(redis_db: str) -> None:
    first = anyio.run(_publish_one, redis_db)
    stream = "eventbus:stream:orders:0"
    with sync_client(redis_db) as r:
        deep = r.xadd(stream, _entry(_deep(1_000))).decode()
        keyed = r.xadd(stream, _entry({b"k": 1})).decode()
        last = r.xadd(stream, _entry({"n": 2})).decode()
        letter = dead_letter_fields(
            topic="orders",
            group="billing",
            shard=0,
            entry_id=deep,
            reason="failed",
            exc=RuntimeError("x"),
            attempts=1,
            original=_entry(_deep(1_000)),
        )
        dlq_id = r.xadd("eventbus:dlq:orders:billing", letter).decode()

    tailed = RUNNER.invoke(app, ["tail", "orders", "--count", "10", "--redis-url", redis_db])
    assert tailed.exit_code == 0, tailed.output
    rows = {row["entry_id"]: row for row in map(json.loads, tailed.output.splitlines())}
    assert list(rows) == [first, deep, keyed, last]
    assert _deep_as_printed(rows[deep]["payload"])
    assert rows[keyed]["payload"] == {"b'k'": 1} and rows[last]["payload"] == {"n": 2}

    shown = RUNNER.invoke(
        app, ["dlq", "show", "orders", "billing", dlq_id, "--redis-url", redis_db]
    )
    assert shown.exit_code == 0, shown.output
    assert _deep_as_printed(json.loads(shown.output)["event"]["payload"])
