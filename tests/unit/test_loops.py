"""The event loop of eventbus's own anyio.run calls (`eventbus.client.loops`): uvloop when
installed, asyncio's loop with EVENTBUS_UVLOOP=0."""

from __future__ import annotations

import asyncio

import pytest

from eventbus.cli.output import run_async
from eventbus.client import loops


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_used_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("EVENTBUS_UVLOOP", raising=False)
    assert loops.backend_options() == {"use_uvloop": True}
    assert loops.run(loop_module).startswith("uvloop")
    assert run_async(loop_module).startswith("uvloop")  # what `eventbus run` goes through


def test_uvloop_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_UVLOOP", "0")
    assert loops.backend_options() == {}
    assert loops.run(loop_module).startswith("asyncio")
