"""``eventbus run --processes N`` (`eventbus.cli.run._run_processes`): a SIGTERM that comes while
the children are being started reaches every child started, and starts no more. Before, the
parent installed its forwarding handler after starting all N: a SIGTERM meanwhile ended the
parent (exit 143) and left the children it had started running, orphaned (found walking the
README: SIGTERM 2.5 s after ``eventbus run app:bus --processes 2``)."""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

run_cli = importlib.import_module("eventbus.cli.run")  # (eventbus.cli.run is also the command)


class _Child:
    """A started child as `_run_processes` sees it: the signals it was sent; it exits 0."""

    started: ClassVar[list[_Child]] = []
    operator_sends: ClassVar[int] = signal.SIGTERM

    def __init__(self, cmd: list[str], **_: Any) -> None:
        self.cmd, self.signals, self.pid = cmd, [], 1_000_000 + len(self.started)
        _Child.started.append(self)
        if len(self.started) == 1:  # the operator's signal arrives while the first starts
            os.kill(os.getpid(), self.operator_sends)

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def wait(self) -> int:
        return 0


@pytest.fixture
def own_handlers() -> Iterator[list[int]]:
    """SIGTERM/SIGINT caught by this test (not its process's end), restored afterwards;
    yields the signals that reached this process's own handler (none should)."""
    caught: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in saved:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    _Child.started = []
    _Child.operator_sends = signal.SIGTERM
    try:
        yield caught
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_sigterm_while_children_start_reaches_them_and_starts_no_more(
    monkeypatch: pytest.MonkeyPatch, own_handlers: list[int]
) -> None:
    monkeypatch.setattr(run_cli.subprocess, "Popen", _Child)
    run_cli._run_processes("app:bus", 3, "127.0.0.1", None, ["--log-level", "info"])
    assert [c.signals for c in _Child.started] == [[signal.SIGTERM]]  # one child, told to stop
    assert _Child.started[0].cmd[-4:] == ["run", "app:bus", "--log-level", "info"]
    assert own_handlers == []  # forwarded, not taken by the parent's previous handler


def test_a_sigint_is_forwarded_as_sigterm(
    monkeypatch: pytest.MonkeyPatch, own_handlers: list[int]
) -> None:
    """A ctrl-C reaches the children itself (the terminal signals the foreground process
    group): a forwarded SIGINT was each child's second, which forces it (`stop_on_signal`);
    a SIGTERM asks for the same graceful shutdown and is harmless when repeated."""
    monkeypatch.setattr(run_cli.subprocess, "Popen", _Child)
    monkeypatch.setattr(_Child, "operator_sends", signal.SIGINT)
    run_cli._run_processes("app:bus", 3, "127.0.0.1", None, ["--log-level", "info"])
    assert [c.signals for c in _Child.started] == [[signal.SIGTERM]]
    assert own_handlers == []
