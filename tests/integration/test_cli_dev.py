"""``eventbus --version`` and ``eventbus run --reload``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eventbus.cli import app
from eventbus.errors import ConfigError

APP = """
import os, pathlib
from pydantic import BaseModel
from eventbus import EventBus

pathlib.Path("started.txt").open("a").write(f"{{os.getpid()}} {generation}\\n")
bus = EventBus.from_env(shards=2)


class Ping(BaseModel):
    n: int


@bus.subscriber("pings", group="g")
async def on_ping(event: Ping) -> None:
    pass
"""


def test_version() -> None:
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output == f"eventbus {version('eventbus')}\n"


def test_reload_without_watchfiles_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from eventbus.cli.reload import run_reloading

    monkeypatch.setitem(sys.modules, "watchfiles", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'eventbus\[dev\]'"):
        run_reloading(["run", "app:bus", "--reload"])


def _started(folder: Path) -> list[list[str]]:
    path = folder / "started.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, within_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    # (a start imports eventbus, pydantic and redis: ~1 s on a quiet machine, 12 s at load 12)
    deadline = time.monotonic() + within_s
    while not predicate():  # a child process's file: polled
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_run_reload_restarts_on_a_change(tmp_path: Path, redis_db: str) -> None:
    (tmp_path / "svc.py").write_text(APP.format(generation=1))
    env = {**os.environ, "REDIS_URL": redis_db}
    cmd = [sys.executable, "-m", "eventbus.cli", "run", "svc:bus", "--reload"]
    parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_started(tmp_path)) == 1)
        (tmp_path / "svc.py").write_text(APP.format(generation=2))
        _wait_for(lambda: len(_started(tmp_path)) == 2)
        (first_pid, first), (second_pid, second) = _started(tmp_path)
        assert (first, second) == ("1", "2") and first_pid != second_pid
    finally:
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=30)
    assert parent.returncode == 0, err
    assert "restarting" in err
