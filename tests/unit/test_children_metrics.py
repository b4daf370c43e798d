"""`ChildrenMetrics`: ``/metrics`` of ``eventbus run --processes N`` over the children's
multiprocess metric files, with a file a child is still creating among them."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from eventbus.ops.children_metrics import ChildrenMetrics
from eventbus.ops.health import serve

CHILD = """
from prometheus_client import Counter, Gauge
Counter("eventbus_test_handled_total", "handled").inc(3)
Gauge("eventbus_test_ready", "ready", multiprocess_mode="liveall").set(1)
"""


class _Probe:
    def live(self) -> tuple[bool, str]:
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        return True, "ok"


def _child_writes_its_metrics(path: Path) -> None:
    """A process in prometheus-client's multiprocess mode writes its metric files into `path`."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(path)}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True)


def _scrape(port: int) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.status, resp.read().decode()


def test_a_metric_file_a_child_is_still_creating_is_left_out_of_the_scrape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _child_writes_its_metrics(tmp_path)
    # another child between creating its files and writing their header: empty (prometheus
    # client's reader fails with struct.error), and one whose header claims entries the file
    # does not hold yet
    (tmp_path / "counter_4242.db").write_bytes(b"")
    (tmp_path / "gauge_liveall_4242.db").write_bytes(struct.pack("i", 64))
    registry = CollectorRegistry()
    ChildrenMetrics(registry, path=str(tmp_path))
    server = serve("127.0.0.1", 0, _Probe(), registry)
    try:
        with caplog.at_level(logging.WARNING, logger="eventbus.ops.children_metrics"):
            for _ in range(2):
                status, text = _scrape(server.server_port)
                assert status == 200
                # the first child's metrics, merged as prometheus-client merges them
                assert "eventbus_test_handled_total 3.0" in text
                ready = [ln for ln in text.splitlines() if ln.startswith("eventbus_test_ready{")]
                assert ready == [f'eventbus_test_ready{{pid="{_pid(tmp_path)}"}} 1.0']
    finally:
        server.shutdown()
        server.server_close()
    # each unreadable file named once, for both scrapes
    # (from the message: a log filter installed by an earlier test may have formatted the args)
    messages = [r.getMessage() for r in caplog.records]
    skipped = sorted(
        n for n in ("counter_4242.db", "gauge_liveall_4242.db") for m in messages if n in m
    )
    assert skipped == ["counter_4242.db", "gauge_liveall_4242.db"]
    assert sum("left out" in m for m in messages) == 2


def test_the_metrics_are_back_once_the_child_has_written_its_file(tmp_path: Path) -> None:
    written, shared = tmp_path / "written", tmp_path / "shared"
    written.mkdir()
    shared.mkdir()
    _child_writes_its_metrics(written)
    (name,) = (p.name for p in written.glob("counter_*.db"))
    (shared / name).write_bytes(b"")  # created, not written yet
    collector = ChildrenMetrics(None, path=str(shared))
    assert list(collector.collect()) == []
    (shared / name).write_bytes((written / name).read_bytes())  # written
    samples = {s.name: s.value for m in collector.collect() for s in m.samples}
    assert samples == {"eventbus_test_handled_total": 3.0}


def test_a_folder_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        ChildrenMetrics(None, path=str(tmp_path / "missing"))


def _pid(path: Path) -> str:
    """The pid of the child whose liveall gauge file is complete in `path`."""
    (name,) = (p.name for p in path.glob("gauge_liveall_*.db") if "_4242" not in p.name)
    return name.removesuffix(".db").rsplit("_", 1)[1]
