"""`ChildrenHealth` over the children's multiprocess metric files, read as prometheus_client
reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from eventbus.ops.health import ChildrenHealth


def test_a_metric_file_a_child_is_still_creating_gives_a_503_reason_not_a_traceback(
    tmp_path: Path,
) -> None:
    # a child between creating its file and writing the file's header: empty, as prometheus_client
    # leaves it for a moment (seen as a /readyz traceback in CI under load)
    (tmp_path / "gauge_liveall_4242.db").write_bytes(b"")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        health = ChildrenHealth([child], registry)
        for ok, reason in (health.ready(), health.live()):
            assert not ok
            assert "metric files could not be read" in reason
    finally:
        child.communicate(b"")
