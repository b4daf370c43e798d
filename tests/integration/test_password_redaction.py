"""Issue 10 item 1: a Redis password never reaches an error, a log line or the terminal.

A private redis-server with ``requirepass``; the library and the CLI (``run``, ``stats``,
``publish``, ``tail``, ``dlq``) are given a wrong password and must say so without printing it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support import Tick
from typer.testing import CliRunner

from eventbus import EventBus, PublishError, RedisUnavailable, Settings
from eventbus.cli import app
from eventbus.testing.server import RedisServer

PASSWORD = "p/ss#w0rd-s3cret"  # '/' and '#' need percent-encoding in a URL
ENCODED = "p%2Fss%23w0rd-s3cret"
WRONG = "wr0ng-s3cret-value"
RUNNER = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        with redis.Redis(port=srv.port) as client:
            client.config_set("requirepass", PASSWORD)
        yield srv


def _url(server: RedisServer, password: str) -> str:
    return f"redis://:{password}@127.0.0.1:{server.port}/0"


def _clean(text: str) -> None:
    for secret in (WRONG, PASSWORD, ENCODED):
        assert secret not in text
    assert "***" in text


@pytest.mark.anyio
async def test_library_errors_redact_the_password(server: RedisServer) -> None:
    bus = EventBus(Settings(redis_url=_url(server, WRONG), publish_timeout_s=0.5))
    with pytest.raises(RedisUnavailable) as info:
        async with bus:
            pass
    _clean(str(info.value))
    assert "invalid username-password" in str(info.value)
    with pytest.raises(PublishError) as failed:
        await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")
    for secret in (WRONG, PASSWORD, ENCODED):
        assert secret not in str(failed.value)
    assert WRONG not in repr(bus.settings) and "***" in repr(bus.settings)
    await bus.aclose()


@pytest.mark.anyio
async def test_a_percent_encoded_password_with_slash_and_hash_connects(
    server: RedisServer,
) -> None:
    bus = EventBus(Settings(redis_url=_url(server, ENCODED)))
    async with bus:
        assert await bus.redis.ping()
    await bus.aclose()


@pytest.mark.parametrize(
    "args",
    [
        ["stats"],
        ["tail", "orders"],
        ["publish", "orders", "--type", "T", "--resource-id", "r"],
        ["dlq", "list", "orders", "billing"],
    ],
)
def test_cli_commands_redact_the_password(server: RedisServer, args: list[str]) -> None:
    result = RUNNER.invoke(app, [*args, "--redis-url", _url(server, WRONG)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    _clean(result.output)


def test_cli_redacts_a_password_from_the_environment(server: RedisServer) -> None:
    result = RUNNER.invoke(app, ["stats"], env={"REDIS_URL": _url(server, WRONG), "COLUMNS": "200"})
    assert result.exit_code == 1
    _clean(result.output)


def test_eventbus_run_redacts_the_password(server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "svc.py").write_text(
        textwrap.dedent(
            """
            from eventbus import EventBus
            from pydantic import BaseModel

            bus = EventBus.from_env()

            class E(BaseModel):
                n: int

            @bus.subscriber("orders", group="billing")
            async def handle(event: E) -> None: ...
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "eventbus.cli", "run", "svc:bus", "--log-level", "debug"],
        cwd=tmp_path,
        env={"REDIS_URL": _url(server, WRONG), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output
    assert "invalid username-password" in output
    _clean(output)
