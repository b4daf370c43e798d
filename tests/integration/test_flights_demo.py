"""``python -m examples.flights --limit 5000`` end to end: the real command in a subprocess, with
its own private redis-server (no REDIS_URL), its consumer processes, and its JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

LIMIT = 5000
JOB_TIMEOUT_S = 840
"""How long the job may take: ~60-160 s alone on 2 cores, 240 s and more at load 12 (its
consumer and Spark processes start Python and the JVM). Within the tests' own bound below."""


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_flights_demo_small_run(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "EVENTBUS_REDIS_URL")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.flights",
            "--limit",
            str(LIMIT),
            "--summary-json",
            str(summary_file),
            "--no-progress",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # `python -m examples.flights` from the root
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(summary_file.read_text())
    assert summary["redis"] == "private"
    assert summary["events_published"] == LIMIT
    assert summary["events_handled"] == summary["events_published"]
    assert summary["groups"]["aggregate"]["handled"] == LIMIT
    assert summary["order_violations"] == 0
    assert summary["lost"] == 0
    assert summary["duplicates"] == 0  # no crash in this run, so no redelivery
    assert summary["aggregates_match"] is True
    assert summary["groups"]["order-check"]["processes"] == 3
    assert summary["options"]["batch"] == 500  # the default: a bulk load with publish_many
    # CPU per event, and the fixed part of it (before the first event) that --limit inflates
    assert summary["publisher_cpu_us_per_event"] > summary["publish_step_cpu_us_per_event"] > 0
    assert 0 < summary["publisher_setup_cpu_s"] < summary["cpu_s"]["publisher_process"]
    assert 0 < summary["consumer_setup_cpu_s"] < summary["cpu_s"]["consumer_processes"]
    for key in ("publish_events_per_s", "consume_events_per_s"):
        assert summary[key] > 0
    assert 0 <= summary["latency_ms_p50"] <= summary["latency_ms_p99"]
    # the durable tier: every published flight archived once, and the replay agrees with the CSV
    tier = summary["tier"]
    assert tier["exactly_once"] is True and tier["entries"] == LIMIT
    assert tier["replay_aggregates_match"] is True
    assert tier["segments"] >= 1 and tier["compression_ratio"] > 1
    assert (
        summary["checks"]["archive_exactly_once"] and summary["checks"]["replay_aggregates_match"]
    )
    # the Spark step: segments + Redis tail read as one DataFrame, checked against the CSV
    assert summary["spark_rows"] == LIMIT
    assert summary["spark_events_per_s"] > 0
    assert summary["spark_aggregates_match"] is True
    assert summary["spark_order_ok"] is True
    assert summary["spark_read_path"] == "native"  # typed segments, Spark's Parquet reader
    assert summary["spark_startup_s"] > 0
    assert summary["checks"]["spark_aggregates_match"] and summary["checks"]["spark_order_ok"]


KILL_LIMIT, KILL_AFTER = 3000, 1000


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_flights_demo_survives_a_consumer_killed_mid_run(tmp_path: Path) -> None:
    """``--kill-after``: one order-check process is SIGKILLed after its group handled 1,000 of
    3,000 flights; the others take its shards over once its liveness (2 s here) expires. The
    publisher is paced (``--rate 1000``: 3 s of publishing), so the kill falls mid-run
    whatever the load: the watcher polls every 0.1 s while 2 s of flights are still to come."""
    summary_file = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "EVENTBUS_REDIS_URL")}
    env["EVENTBUS_LIVENESS_TTL_S"] = "2"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.flights",
            "--limit",
            str(KILL_LIMIT),
            "--kill-after",
            str(KILL_AFTER),
            "--rate",
            "1000",
            "--no-spark",
            "--no-archive",
            "--summary-json",
            str(summary_file),
            "--no-progress",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join((proc.stdout + proc.stderr).split())  # rich wraps its lines
    assert f"killing order-check-1 (SIGKILL) after {KILL_AFTER:,} events" in said
    summary = json.loads(summary_file.read_text())
    assert summary["exited_early"] == ["order-check-1"]  # the kill happened, and only it
    assert summary["events_published"] == KILL_LIMIT
    assert summary["lost"] == 0
    assert summary["order_violations"] == 0
    assert summary["aggregates_match"] is True
    assert summary["dead_lettered"] == 0
    order = summary["groups"]["order-check"]
    assert order["handled"] == KILL_LIMIT
    # the killed process wrote no report: the survivors handled the rest, its shards included
    assert sorted(order["handled_per_process"]) == ["order-check-2", "order-check-3"]
    assert sum(order["handled_per_process"].values()) >= KILL_LIMIT - KILL_AFTER
    assert all(summary["checks"].values()), summary["checks"]
