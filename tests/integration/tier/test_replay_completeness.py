"""``eventbus replay`` never reports an empty or holed archive as success.

A mistyped ``--store`` path is an error (and nothing is created there); a topic with no segments
is an error; a segment deleted from the middle of a shard's range is detected against the
offloader checkpoint and fails the command, or only warns with ``--allow-gaps``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import Tick, resources_per_shard
from tier_support import fast_tier, make_bus, publish_ticks
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.tier.gaps import Gap
from eventbus.tier.layout import gap_prefix
from eventbus.tier.offloader import Offloader
from eventbus.tier.replay import ArchiveGap, check_complete
from eventbus.tier.store import StoreNotFound, list_keys_sync, open_store
from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.integration
RUNNER = CliRunner(env={"COLUMNS": "200"})


def test_a_missing_store_path_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "segments"
    result = RUNNER.invoke(app, ["replay", "orders", "--store", str(missing), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "no segment store" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "typo").exists()
    with pytest.raises(StoreNotFound):
        open_store(f"file://{missing}", create=False)


def test_a_topic_without_segments_is_an_error(tmp_path: Path) -> None:
    result = RUNNER.invoke(app, ["replay", "orders", "--store", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "no archived segments of topic 'orders'" in result.output


def test_a_deleted_middle_segment_fails_replay_unless_gaps_are_allowed(
    redis_db: str, tmp_path: Path
) -> None:
    async def publish() -> None:
        bus = make_bus(redis_db, shards=1)
        async with bus:
            await publish_ticks(bus, "holes", 60, resources=3)
        await bus.aclose()

    anyio.run(publish)
    store = tmp_path / "segs"
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    args = ["--store", str(store), "--redis-url", redis_db]
    off = RUNNER.invoke(app, ["offload", "--once", *args, "--segment-max-entries", "20"], env=env)
    assert off.exit_code == 0, off.output
    segments = sorted((store / "holes" / "shard=0").glob("*.parquet"))
    assert len(segments) == 3

    whole = RUNNER.invoke(app, ["replay", "holes", *args, "--no-progress"])
    assert whole.exit_code == 0, whole.output
    assert "missing" not in whole.output

    segments[1].unlink()  # the middle one: the first and last key ranges look fine
    holed = RUNNER.invoke(app, ["replay", "holes", *args, "--no-progress"])
    assert holed.exit_code == 1, holed.output
    assert "20 entries are missing from the archive" in holed.output
    assert "Traceback" not in holed.output

    allowed = RUNNER.invoke(app, ["replay", "holes", *args, "--no-progress", "--allow-gaps"])
    assert allowed.exit_code == 0, allowed.output
    assert "warning" in allowed.output and "missing from the archive" in allowed.output
    events = [json.loads(x) for x in allowed.stdout.splitlines() if x.startswith("{")]
    assert len(events) == 40


def test_replay_checks_the_checkpoints_on_a_cluster(
    redis_cluster: ReplicatedCluster, tmp_path: Path
) -> None:
    """With ``EVENTBUS_CLUSTER=true`` replay asked a plain client of the URL's node for the
    checkpoint hash, which lives on the ``{eventbus}`` slot's node: ``MovedError``, "not checked
    for missing segments", and a holed archive replayed with exit code 0."""
    coordination = redis_cluster.primary_of("{eventbus}")
    other = next(p for p in redis_cluster.primary_ports() if p != coordination)
    url = f"redis://127.0.0.1:{other}/0"  # a seed node without the checkpoints
    topic = "holes-cluster"

    async def publish() -> None:
        bus = make_bus(url, shards=1, cluster=True)
        async with bus:
            await publish_ticks(bus, topic, 60, resources=3)
        await bus.aclose()

    anyio.run(publish)
    store = tmp_path / "segs"
    env = {
        "EVENTBUS_CLUSTER": "true",
        "EVENTBUS_TIER_HOT_WINDOW_S": "0",
        "EVENTBUS_TIER_TRIM_EXACT": "true",
    }
    args = ["--store", str(store), "--redis-url", url]
    off = RUNNER.invoke(app, ["offload", "--once", *args, "--segment-max-entries", "20"], env=env)
    assert off.exit_code == 0, off.output
    segments = sorted((store / topic / "shard=0").glob("*.parquet"))
    assert len(segments) == 3

    whole = RUNNER.invoke(app, ["replay", topic, *args, "--no-progress"], env=env)
    assert whole.exit_code == 0, whole.output
    assert "not checked" not in whole.output and "missing" not in whole.output

    segments[1].unlink()
    holed = RUNNER.invoke(app, ["replay", topic, *args, "--no-progress"], env=env)
    assert holed.exit_code == 1, holed.output
    assert "20 entries are missing from the archive" in holed.output


def test_check_complete_counts_gap_records_as_accounted(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    gaps = check_complete(store, "t", {0: 10, 1: 5}, {0: 10, 1: 8, 2: 1})
    assert [(g.shard, g.accounted, g.archived) for g in gaps] == [(1, 8, 5), (2, 1, 0)]
    assert all(isinstance(g, ArchiveGap) for g in gaps)
    gap = Gap("t", 1, "0-0", "9-0", 3, 1, "offloader", "trimmed before archiving")
    (tmp_path / gap.key).parent.mkdir(parents=True)
    (tmp_path / gap.key).write_text(json.dumps(asdict(gap)))
    assert [g.shard for g in check_complete(store, "t", {0: 10, 1: 5}, {1: 8, 2: 1})] == [2]


class Crash(Exception):
    pass


def test_replay_while_a_gap_is_accounted_but_unrecorded(redis_db: str, tmp_path: Path) -> None:
    """The completeness check read `<shard>:count`, which includes a gap accounted
    whose record is not stored yet: "entries are missing (a deleted segment?)", exit 1."""
    segs = tmp_path / "segs"

    async def crash_after_accounting(at: str, shard: int, key: str) -> None:
        if at == "gap_accounted":
            raise Crash(key)

    async def setup() -> int:
        bus = make_bus(redis_db, shards=1)
        bus.topic("lossy", shards=1, maxlen=100)
        store = open_store(str(segs))
        async with bus:
            await publish_ticks(bus, "lossy", 50)
            await Offloader(
                bus.redis, store, settings=bus.settings, tier=fast_tier()
            ).run_until_caught_up(20)
            await publish_ticks(bus, "lossy", 1000, start=50)  # MAXLEN ~ 100 trims most
            with pytest.raises(Crash):
                await Offloader(
                    bus.redis,
                    store,
                    settings=bus.settings,
                    tier=fast_tier(),
                    hook=crash_after_accounting,
                ).run_until_caught_up(20)
            cps = bus.keys.checkpoints("lossy")
            gap = json.loads(await bus.redis.hget(cps, "0:gap"))
            assert list_keys_sync(store, gap_prefix("lossy", 0)) == []
        await bus.aclose()
        return int(gap["lost_entries"])

    lost = anyio.run(setup)
    assert lost > 0
    out = RUNNER.invoke(
        app, ["replay", "lossy", "--store", str(segs), "--redis-url", redis_db, "--no-progress"]
    )
    # the archive is whole (50 archived entries, the loss is accounted, its record pending):
    # expected exit 0 or a message naming the unrecorded gap, not "a deleted segment?"
    assert out.exit_code == 0, out.output[-400:]


@pytest.mark.single_node("the CLI on one Redis; the cluster case is test_replay_completeness's")
def test_replay_of_a_topic_one_of_whose_shards_lost_every_segment_fails(
    redis_db: str, tmp_path: Path
) -> None:
    """Replay refuses holes (tier.md "Replay"; tests/integration/tier/test_replay_completeness:
    "a segment deleted ... is detected against the offloader checkpoint and fails the command").

    `eventbus replay` checks completeness only for the shards `plan` found: those with a folder
    in the store (tier/cli/replay.py ``_check_gaps(..., sorted(segments), ...)``, shards from
    `list_shards_sync`). A shard whose every segment is gone (deleted, expired by a bucket
    lifecycle rule, a prefix copied without it) has no folder, so it is not checked against its
    checkpoint at all: a topic of 2 shards with shard 1's 30 archived entries missing replays
    shard 0 alone and exits 0 without a word (the store's "folder" is a key prefix: on S3 it
    is gone with its last object; the test removes the emptied local folder likewise). A
    segment deleted from the middle of a shard is detected (test_replay_completeness).
    """
    import anyio
    from typer.testing import CliRunner

    from eventbus.cli import app

    runner = CliRunner(env={"COLUMNS": "200"})
    a, b = resources_per_shard(2)  # one resource per shard

    async def publish() -> None:
        bus = EventBus(Settings(redis_url=redis_db, shards=2))
        async with bus:
            for seq in range(30):
                await bus.publish("two", Tick(resource=a, seq=seq), resource_id=a)
                await bus.publish("two", Tick(resource=b, seq=seq), resource_id=b)
        await bus.aclose()

    anyio.run(publish)
    store = tmp_path / "segs"
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    args = ["--store", str(store), "--redis-url", redis_db]
    off = runner.invoke(app, ["offload", "--once", *args], env=env)
    assert off.exit_code == 0, off.output
    whole = runner.invoke(app, ["replay", "two", *args, "--no-progress"])
    assert whole.exit_code == 0 and "missing" not in whole.output, whole.output
    for segment in (store / "two" / "shard=1").glob("*.parquet"):  # every segment of shard 1
        segment.unlink()
    (store / "two" / "shard=1").rmdir()
    holed = runner.invoke(app, ["replay", "two", *args, "--no-progress"])
    replayed = [line for line in holed.stdout.splitlines() if line.startswith("{")]
    assert holed.exit_code == 1, (
        f"replay exited {holed.exit_code} with {len(replayed)} of 60 events and shard 1's 30 "
        f"archived entries missing: {holed.output[-300:]!r}"
    )
    assert "30 entries are missing from the archive" in holed.output


def test_replay_during_an_offload_reports_no_missing_segment(
    redis_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eventbus replay`` lists the segments first (`plan`) and reads the checkpoint counts
    last (`_check_gaps`): a segment the offloader commits meanwhile is counted by the checkpoint
    and not read, and the complete archive is reported as holed (exit 1, "20 entries are
    missing from the archive (a deleted segment?)"). check_complete's docstring says such
    segments only make the archive look longer."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    import eventbus.tier.replay as replay_module
    from eventbus.cli import app

    runner = CliRunner(env={"COLUMNS": "200"})
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    store = tmp_path / "segs"
    args = ["--store", str(store), "--redis-url", redis_db]
    offload = [sys.executable, "-m", "eventbus.cli", "offload", "--once", *args]
    offload += ["--segment-max-entries", "20"]

    async def publish(first: int, n: int) -> None:
        bus = EventBus(Settings(redis_url=redis_db, shards=1))
        async with bus:
            await bus.publish_many(
                "live", [(f"r{i % 3}", Tick(resource=f"r{i % 3}", seq=i)) for i in range(first, n)]
            )
        await bus.aclose()

    anyio.run(publish, 0, 60)
    done = subprocess.run(offload, env={**os.environ, **env}, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    anyio.run(publish, 60, 80)  # the offloader's next segment, archived during the replay

    planned = replay_module.plan

    def plan_then_offload(*a: Any, **kw: Any) -> Any:
        segments = planned(*a, **kw)
        again = subprocess.run(offload, env={**os.environ, **env}, capture_output=True, timeout=120)
        assert again.returncode == 0, again.stderr
        return segments

    monkeypatch.setattr(replay_module, "plan", plan_then_offload)
    result = runner.invoke(app, ["replay", "live", *args, "--no-progress"])
    events = [x for x in result.stdout.splitlines() if x.startswith("{")]
    assert len(events) == 60  # what the store held when the replay listed it
    assert len(list((store / "live" / "shard=0").glob("*.parquet"))) == 4  # nothing deleted
    assert result.exit_code == 0, result.output[-500:]
