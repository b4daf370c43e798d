"""Metrics and health: publish, handler, shard and lag metrics, /healthz and /readyz of one process,
and ``eventbus run --processes 2 --metrics-port``: the metrics and the health of both children,
served by the parent."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import Recorder, Tick, running, wait_until

from eventbus import Context, EventBus
from eventbus.config import Settings
from eventbus.ops.health import Health, serve
from localredis.server import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


async def aget(port: int, path: str) -> tuple[int, str]:
    return await anyio.to_thread.run_sync(_get, port, path)


def _value(text: str, sample: str) -> float:
    """The value of the exposition line starting with `sample` (name and labels), or 0."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def test_metrics_and_probes_of_one_process(settings: type[Settings]) -> None:
    bus = EventBus(settings(trim_check_s=0.05))
    rec = Recorder()

    @bus.subscriber("metered", group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    labels = (
        'group="g",handler="test_metrics_and_probes_of_one_process.<locals>.handle",topic="metered"'
    )
    calls = "eventbus_handler_duration_seconds_count{" + labels + "}"
    health = Health(lambda: bus.consumers)
    server = serve("127.0.0.1", 0, health)
    port = server.server_port
    try:
        assert (await aget(port, "/healthz"))[0] == 503  # no tick yet
        assert (await aget(port, "/readyz"))[0] == 503
        async with running(bus), anyio.create_task_group() as tg:
            tg.start_soon(health.tick, 0.05)
            await wait_until(lambda: health.ready()[0])
            assert await aget(port, "/healthz") == (200, "ok\n")
            assert await aget(port, "/readyz") == (200, "ok\n")
            first = (await aget(port, "/metrics"))[1]  # the registry is the process's:
            before = _value(first, "eventbus_published_total")  # counters of earlier tests
            calls_before = _value(first, calls)
            await bus.publish_many(
                "metered", [(f"r{i}", Tick(resource="r", seq=i)) for i in range(5)]
            )
            await rec.wait_for(5)

            text = ""

            async def reported() -> bool:  # lag by a trim check after the events were handled,
                nonlocal text  # and readiness by a health tick
                text = (await aget(port, "/metrics"))[1]
                lines = _metered_lags(text)
                lag = len(lines) == 4 and all(line.endswith(" 0.0") for line in lines)
                return lag and bool(_READY.search(text))

            await wait_until(reported)
            tg.cancel_scope.cancel()
    finally:
        server.shutdown()
    assert _value(text, "eventbus_published_total") - before == 5
    assert _value(text, "eventbus_publish_batch_size_count") >= 1
    assert _value(text, "eventbus_publish_pipeline_seconds_count") >= 1
    assert _value(text, calls) - calls_before == 5
    assert _value(text, 'eventbus_shards_held{group="g",topic="metered"}') == 4
    taken = 'eventbus_shard_locks_taken_total{group="g",how="free",topic="metered"}'
    assert _value(text, taken) >= 4
    lags = _metered_lags(text)  # the registry is the process's: other tests' topics are there
    assert lags and all(line.endswith(" 0.0") for line in lags), lags
    # (a gauge of multiprocess mode, if an earlier test of this process set it up, has a pid label)
    assert _READY.search(text), text[-500:]


def test_liveness_fails_when_the_loop_stops_ticking(settings: type[Settings]) -> None:
    bus = EventBus(settings())
    health = Health(lambda: bus.consumers, stall_s=0.5)
    assert health.live() == (False, "event loop not started")
    health.last_tick = time.monotonic()
    assert health.live() == (True, "ok")
    health.last_tick = time.monotonic() - 2
    ok, reason = health.live()
    assert not ok and "event loop blocked" in reason
    assert health.ready() == (False, "no consumer running yet")


APP = """
from pydantic import BaseModel
from eventbus import EventBus

class Tick(BaseModel):
    resource: str
    seq: int

bus = EventBus.from_env()

@bus.subscriber("multi", group="g")
async def handle(event: Tick) -> None:
    pass
"""


@contextlib.contextmanager
def _two_processes(
    redis_db: str, tmp_path: Path, multiproc_dir: Path | None = None
) -> Iterator[tuple[int, subprocess.Popen[str], list[dict[str, Any]]]]:
    """``eventbus run --processes 2 --metrics-port`` (JSON logs) on `multiproc_dir` (None: its
    own temporary folder); yields its port, its process and its stderr's log records (filled
    once the run stopped: SIGTERM, exit 0)."""
    (tmp_path / "multi_app.py").write_text(textwrap.dedent(APP))
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_db,
        "EVENTBUS_SHARDS": "4",
        "EVENTBUS_BLOCK_MAX_MS": "100",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    cmd = [sys.executable, "-m", "eventbus.cli", "run", "multi_app:bus", "--processes", "2"]
    cmd += ["--metrics-port", str(port), "--log-format", "json"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    records: list[dict[str, Any]] = []
    try:
        yield port, proc, records
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    records += [json.loads(line) for line in err.splitlines() if line.strip()]


START_WITHIN_S = 180
"""How long two child processes may take to serve ready and live: seconds alone, over a minute at
load 12 (each imports eventbus and starts its consumer; liveness needs a tick of each)."""


def _wait_ready_and_live(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + START_WITHIN_S
    while _get(port, "/readyz")[0] != 200:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, _get(port, "/readyz")
        time.sleep(0.1)
    # liveness: every child ticked lately (a starved CI machine may miss one tick: wait)
    while _get(port, "/healthz") != (200, "ok\n"):
        assert time.monotonic() < deadline, _get(port, "/healthz")
        time.sleep(0.1)


def test_processes_share_one_metrics_port(redis_db: str, tmp_path: Path) -> None:
    with _two_processes(redis_db, tmp_path) as (port, proc, records):
        _wait_ready_and_live(port, proc)
        text = _get(port, "/metrics")[1]
        ready = [line for line in text.splitlines() if line.startswith("eventbus_ready{")]
        assert len(ready) == 2, text  # one per child process (pid label)
        held = _value(text, 'eventbus_shards_held{group="g",topic="multi"}')
        assert held >= 1  # summed over the live children
    # each child logs as a consumer; the parent may log too (a scrape that met a metric file a
    # child was still creating warns from eventbus.ops.children_metrics): not a third consumer
    consumers = {r["pid"] for r in records if r["logger"] == "eventbus.consumer"}
    assert len(consumers) == 2 and proc.pid not in consumers, records


def test_a_metric_file_being_created_does_not_fail_the_scrape(
    redis_db: str, tmp_path: Path
) -> None:
    # a child between creating a metric file and writing its header: the file is empty (here
    # for the whole run), and prometheus-client's reader fails on it with struct.error
    (folder := tmp_path / "metrics").mkdir()
    (folder / "counter_4242.db").write_bytes(b"")
    with _two_processes(redis_db, tmp_path, folder) as (port, proc, records):
        deadline = time.monotonic() + START_WITHIN_S
        while (scrape := _get(port, "/metrics"))[0] == 0:  # not listening yet
            assert time.monotonic() < deadline, scrape
            time.sleep(0.1)
        assert scrape[0] == 200, scrape  # a 500 with a traceback on main
        _wait_ready_and_live(port, proc)  # the file does not hold the health probes at 503 either
        status, text = _get(port, "/metrics")
        assert status == 200
        ready = [line for line in text.splitlines() if line.startswith("eventbus_ready{")]
        # both children's, the empty file left out (one CI run of 75bb274's tree saw none here,
        # right after /readyz answered 200; not reproduced in 16 runs: the parent's log lines
        # and the folder's files are in the message for the next one)
        files = sorted(p.name for p in folder.iterdir())
        assert len(ready) == 2, (text, files, records)
        assert all(r.endswith(" 1.0") for r in ready), text
        assert f'pid="{proc.pid}"' not in text  # nor the parent's own gauges (not a child)
    skipped = [r for r in records if r["logger"] == "eventbus.ops.children_metrics"]
    assert len(skipped) == 1, skipped  # logged once, for all the scrapes
    assert skipped[0]["level"] == "WARNING"
    assert "counter_4242.db" in skipped[0]["message"]


def _metered_lags(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line.startswith("eventbus_consumer_lag{") and 'topic="metered"' in line
    ]


# (a gauge of multiprocess mode, if an earlier test of this process set it up, has a pid label)
_READY = re.compile(r"^eventbus_ready(\{[^}]*\})? 1\.0$", re.M)
