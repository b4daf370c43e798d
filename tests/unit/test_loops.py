"""The event loop of eventbus's own anyio.run calls (`eventbus.client.loops`): uvloop when
installed, asyncio's loop with EVENTBUS_UVLOOP=0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import anyio
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


# -- stop_on_signal: the first SIGTERM/SIGINT stops, a repeated SIGTERM is harmless ---------------
class _Said(logging.Handler):
    """Sets `event` when eventbus logs a record whose message holds `words`."""

    def __init__(self, words: str, event: anyio.Event) -> None:
        super().__init__()
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


def _signals_to_self(first: int, second: int, then: str) -> tuple[bool, bool]:
    """Run `stop_on_signal`; send this process `first`, then (once `stop` is set and while the
    receiver still holds the signal) `second`, and wait for the log line holding `then`.
    Returns (stop set, the task still running after the second signal)."""

    async def main() -> tuple[bool, bool]:
        stop, said = anyio.Event(), anyio.Event()
        handler, level = _Said(then, said), loops.log.level
        loops.log.addHandler(handler)
        loops.log.setLevel(logging.INFO)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(loops.stop_on_signal, stop)  # the receiver is installed
                os.kill(os.getpid(), first)
                await stop.wait()
                # before: the receiver was gone here, and SIGTERM's default action ended the
                # process (this test's) at once
                assert signal.getsignal(second) not in (signal.SIG_DFL, signal.default_int_handler)
                os.kill(os.getpid(), second)
                await said.wait()
                running = not tg.cancel_scope.cancel_called
                tg.cancel_scope.cancel()  # the caller ends it once the shutdown is over
            return stop.is_set(), running
        finally:
            loops.log.removeHandler(handler)
            loops.log.setLevel(level)

    return loops.run(main)


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_during_the_graceful_stop_is_logged_and_harmless(first: int) -> None:
    """systemd's KillMode=control-group and ``eventbus run --processes``' forwarding send a
    child two SIGTERMs: the second must not kill it mid-shutdown."""
    assert _signals_to_self(first, signal.SIGTERM, "again") == (True, True)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back once cancelled


def test_a_second_sigint_forces_with_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        _signals_to_self(signal.SIGINT, signal.SIGINT, "forcing")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
