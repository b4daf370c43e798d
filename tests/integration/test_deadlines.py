"""No hangs. Every Redis connection has deadlines, and `publish_timeout_s` is a deadline on the
caller of `publish()`.

A tiny asyncio TCP server on loopback accepts connections and never answers: the library and the
CLI (``run``, ``stats``, ``publish``) must fail with a clear, typed error. A private redis-server
stopped with SIGSTOP in the middle of publishing must make `publish()` raise `PublishError`
close to `publish_timeout_s` (bounded generously: under 3 x the timeout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from support import Tick

from eventbus import EventBus, PublishError, RedisUnavailable, Settings
from localredis.server import RedisServer

FAST = {  # deadlines of a few tenths of a second, so a hang shows within the test's bounds
    "redis_connect_timeout_s": 1.0,
    "redis_timeout_margin_s": 0.3,
    "block_max_ms": 100,
    "block_min_ms": 10,
}


@pytest.fixture(scope="module")
def silent_url() -> Iterator[str]:
    """A TCP server on loopback that accepts every connection and never sends a byte."""
    ready = threading.Event()
    state: dict[str, object] = {}

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):  # swallow whatever comes, answer nothing
            pass
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        state["port"] = server.sockets[0].getsockname()[1]
        state["stop"] = stop = asyncio.Event()
        state["loop"] = asyncio.get_running_loop()
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"redis://127.0.0.1:{state['port']}/0"
    loop, stop = state["loop"], state["stop"]
    loop.call_soon_threadsafe(stop.set)  # type: ignore[attr-defined]
    thread.join(10)


@pytest.mark.anyio
async def test_connecting_to_a_silent_server_is_a_typed_error(silent_url: str) -> None:
    bus = EventBus(Settings(redis_url=silent_url, **FAST))
    with anyio.fail_after(30):  # a hang fails here, not in CI's global timeout
        with pytest.raises(RedisUnavailable, match="did not answer within"):
            async with bus:
                pass
    await bus.aclose()


@pytest.mark.anyio
async def test_publish_to_a_silent_server_raises_publish_error(silent_url: str) -> None:
    bus = EventBus(Settings(redis_url=silent_url, publish_timeout_s=0.5, **FAST))
    started = time.monotonic()
    with anyio.fail_after(30):
        with pytest.raises(PublishError, match=r"not confirmed within 0\.5 s"):
            await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")
    assert time.monotonic() - started < 3 * 0.5 + 1
    await bus.aclose()


def _cli(args: list[str], url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    env |= {"REDIS_URL": url, "COLUMNS": "200"}
    env |= {f"EVENTBUS_{k.upper()}": str(v) for k, v in FAST.items()}
    env["EVENTBUS_PUBLISH_TIMEOUT_S"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "eventbus.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # a hang raises TimeoutExpired: the test fails instead of waiting for ever
    )


@pytest.mark.parametrize(
    "args",
    [
        ["stats"],
        ["publish", "orders", "--type", "T", "--resource-id", "r"],
        ["tail", "orders"],
        ["run", "svc:bus"],
    ],
)
def test_cli_against_a_silent_server_fails_with_one_line(
    silent_url: str, tmp_path: Path, args: list[str]
) -> None:
    (tmp_path / "svc.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel
            from eventbus import EventBus

            bus = EventBus.from_env()

            class E(BaseModel):
                n: int

            @bus.subscriber("orders", group="billing")
            async def handle(event: E) -> None: ...
            """
        )
    )
    proc = _cli(args, silent_url, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "did not answer within" in proc.stderr


@pytest.mark.anyio
async def test_publish_deadline_holds_when_redis_stops_mid_run() -> None:
    """SIGSTOP: the TCP connection stays up and nothing answers (like a partition without RST)."""
    timeout = 1.0
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, publish_timeout_s=timeout, shards=4))
        assert server.proc is not None
        async with bus:
            for i in range(20):  # warm: the topic is checked, connections are open
                await bus.publish("t", Tick(resource=f"r{i}", seq=i), resource_id=f"r{i}")
            server.proc.send_signal(signal.SIGSTOP)
            try:
                errors: list[tuple[BaseException, float]] = []

                async def one(i: int) -> None:
                    started = time.monotonic()
                    try:
                        await bus.publish("t", Tick(resource="x", seq=i), resource_id="x")
                    except PublishError as exc:
                        errors.append((exc, time.monotonic() - started))

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        for i in range(5):
                            tg.start_soon(one, i)
                assert len(errors) == 5
                assert all("not confirmed within" in str(e) for e, _ in errors)
                assert all(elapsed < 3 * timeout for _, elapsed in errors)

                started = time.monotonic()
                with anyio.fail_after(30), pytest.raises(PublishError):
                    await bus.publish_many("t", [("y", Tick(resource="y", seq=0))])
                assert time.monotonic() - started < 3 * timeout
            finally:
                server.proc.send_signal(signal.SIGCONT)
            # and it recovers once Redis answers again
            with anyio.fail_after(30):
                while True:
                    try:
                        await bus.publish("t", Tick(resource="z", seq=0), resource_id="z")
                        break
                    except PublishError:
                        continue
        await bus.aclose()
