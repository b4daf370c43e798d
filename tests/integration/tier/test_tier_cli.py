"""``eventbus offload --once`` and ``eventbus replay`` through the real CLI app."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import anyio
import pandas as pd
import pytest
from tier_support import make_bus, publish_ticks
from typer.testing import CliRunner

from eventbus.cli import app

pytestmark = pytest.mark.integration


def test_offload_once_then_replay_jsonl_and_parquet(redis_db: str, tmp_path: Path) -> None:
    async def publish() -> list[str]:
        bus = make_bus(redis_db, shards=2)
        async with bus:
            published = await publish_ticks(bus, "cli", 120, resources=4)
        await bus.aclose()
        return published

    published = anyio.run(publish)
    store = str(tmp_path / "segs")
    runner = CliRunner()
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    thresholds = gc.get_threshold()
    result = runner.invoke(
        app,
        [
            "offload",
            "--once",
            "--store",
            store,
            "--redis-url",
            redis_db,
            "--segment-max-entries",
            "50",
        ],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert "120 entries" in result.output
    # the command freezes its set-up's heap for the offload (a process of its own); run
    # in-process, it leaves nothing frozen and the collector's thresholds as they were
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds

    result = runner.invoke(app, ["replay", "cli", "--store", store, "--no-progress"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["entry_id"] for line in lines] == sorted(
        published, key=lambda i: tuple(map(int, i.split("-")))
    )
    assert sorted(line["payload"]["seq"] for line in lines) == list(range(120))
    assert {line["event_type"] for line in lines} == {"Tick"}

    result = runner.invoke(
        app, ["replay", "cli", "--store", store, "--resource-id", "res-1", "--no-progress"]
    )
    assert {
        json.loads(x)["resource_id"] for x in result.stdout.splitlines() if x.startswith("{")
    } == {"res-1"}

    out = tmp_path / "export.parquet"
    result = runner.invoke(app, ["replay", "cli", "--store", store, "-o", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_parquet(out)
    assert len(df) == 120 and set(df["resource_id"]) == {f"res-{i}" for i in range(4)}


def test_replay_reports_a_corrupt_segment(tmp_path: Path) -> None:
    seg = tmp_path / "t" / "0"
    seg.mkdir(parents=True)
    name = f"{'0' * 19}1-{'0' * 20}-{'0' * 19}2-{'0' * 20}.parquet"
    (seg / name).write_bytes(b"PAR1 garbage")
    result = CliRunner().invoke(app, ["replay", "t", "--store", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1
    assert "corrupt segment" in result.output and name in result.output.replace("\n", "")
