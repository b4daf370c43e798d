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


def test_the_young_gc_threshold_is_set_by_the_first_block_and_restored_by_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlapping blocks (a bus entered while its consumers run, two buses) restore the
    process's own thresholds only when the last one ends, whatever the order they end in."""
    import gc

    from eventbus.client import loops
    from eventbus.client.loops import young_gc_threshold

    # blocks other tests left open (a SyncBus pinned until exit) are not this test's
    monkeypatch.setattr(loops, "_gc_users", 0)
    monkeypatch.setattr(loops, "_gc_before", loops._gc_before)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        first, second = young_gc_threshold(50_000), young_gc_threshold(20_000)
        first.__enter__()
        assert gc.get_threshold() == (50_000, 10, 10)
        second.__enter__()
        assert gc.get_threshold() == (50_000, 10, 10)  # the first block's value holds
        first.__exit__(None, None, None)  # not the last: nothing restored yet
        assert gc.get_threshold() == (50_000, 10, 10)
        second.__exit__(None, None, None)
        assert gc.get_threshold() == (700, 10, 10)
        with young_gc_threshold(0):
            assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
