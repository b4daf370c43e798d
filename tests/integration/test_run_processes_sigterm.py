"""``eventbus run --processes`` under one SIGTERM to its whole process group: every child, the
busy one included, finishes its handler, acks, releases its shards and exits 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import Tick

from eventbus import EventBus
from eventbus.config import Settings

pytestmark = pytest.mark.integration


_BUSY_APP = """
import anyio, os
from pathlib import Path
from pydantic import BaseModel
from eventbus import EventBus

class Tick(BaseModel):
    resource: str
    seq: int

bus = EventBus.from_env()

@bus.subscriber("term", group="g")
async def handle(event: Tick) -> None:
    Path(f"started-{os.getpid()}").touch()
    while not Path("release").exists():  # the test lets the handler finish
        await anyio.sleep(0.02)
"""


@pytest.mark.single_node("one server's PEL")
@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="orders the signals with Linux's /proc"
)
def test_one_group_sigterm_on_run_processes_shuts_the_children_down_gracefully(
    redis_db: str, tmp_path: Path
) -> None:
    """The interleaving of one group-wide SIGTERM, forced: the busy child gets its SIGTERM and
    starts its graceful shutdown; then the parent gets its own and forwards it to every child.
    The busy child must still finish its handler, ack, release its shard and exit 0.

    Ordering without sleeps: the release comes once the parent's forwarding handler has run
    (`parent_forwarded_or_exited`); a forwarded SIGTERM with its default action kills at
    delivery, before the child runs any more of its code."""
    import json
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    (tmp_path / "busy_app.py").write_text(textwrap.dedent(_BUSY_APP))
    env = {**os.environ, "REDIS_URL": redis_db, "EVENTBUS_SHARDS": "1"}
    env["EVENTBUS_BLOCK_MAX_MS"] = "100"
    cmd = [sys.executable, "-m", "eventbus.cli", "run", "busy_app:bus", "--processes", "2"]
    cmd += ["--log-format", "json"]
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=log_file, start_new_session=True)

    def records() -> list[dict[str, Any]]:
        text = log_path.read_text()
        return [json.loads(x) for x in text.splitlines() if x.startswith("{") and x.endswith("}")]

    def logged(pid: int, words: str) -> bool:
        return any(r.get("pid") == pid and words in r.get("message", "") for r in records())

    def wait_for(predicate: Any) -> Any:  # the state of other processes: polled
        deadline = time.monotonic() + 60
        while not (found := predicate()):
            assert time.monotonic() < deadline, (what(), log_path.read_text()[-3000:])
            time.sleep(0.02)
        return found

    def what() -> str:  # the parent's state, for a failed wait
        try:
            syscall = Path(f"/proc/{proc.pid}/syscall").read_text()
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError as exc:
            return f"parent gone: {exc}"
        pnd = [x for x in status.splitlines() if x.startswith(("SigPnd", "ShdPnd", "State"))]
        return f"parent syscall {syscall.strip()}; {pnd}"

    def parent_forwarded_or_exited() -> bool:
        """The parent took its SIGTERM (not pending) and is back in ``Popen.wait()``'s
        blocking ``wait4`` (/proc/<pid>/syscall: 61, options 0): its forwarding handler ran
        (PEP 475: the handler runs before the interrupted wait4 is retried)."""
        if proc.poll() is not None:
            return True
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            call = [*Path(f"/proc/{proc.pid}/syscall").read_text().split(), "", "", ""][:4]
        except OSError:
            return proc.poll() is not None
        pending = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        term_pending = pending & (1 << (signal.SIGTERM - 1))
        return not term_pending and call[0] == "61" and call[3] == "0x0"

    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        pids = wait_for(lambda: len(found := children.read_text().split()) == 2 and found)
        wait_for(lambda: all(logged(int(p), "starts on topic") for p in pids))

        async def publish() -> None:
            bus = EventBus(Settings(redis_url=redis_db, shards=1))
            async with bus:
                await bus.publish("term", Tick(resource="r", seq=1), resource_id="r")
            await bus.aclose()

        anyio.run(publish)
        started = wait_for(lambda: list(tmp_path.glob("started-*")))
        busy = int(started[0].name.removeprefix("started-"))
        os.kill(busy, signal.SIGTERM)  # the group signal reaches the busy child first
        wait_for(lambda: logged(busy, "shutting down gracefully"))
        os.kill(proc.pid, signal.SIGTERM)  # ... then the parent, which forwards it
        wait_for(parent_forwarded_or_exited)
        (tmp_path / "release").touch()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert logged(busy, "left; released shards"), log_path.read_text()[-3000:]
    assert proc.returncode == 0, log_path.read_text()[-3000:]
