"""The metrics and health port: `eventbus.ops.health.serve` on loopback, with real sockets. Idle
connections are closed after the deadline, connections (threads) are bounded, idle ones give way to
a probe, and a connection beyond busy ones is closed unanswered.

Waiting for a close is a blocking ``recv`` returning ``b""`` (with a guard timeout far above the
configured deadline); thread counts are read until they settle (threads end on their own)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from eventbus.ops.health import Check, serve
from eventbus.ops.http_server import BoundedWSGIServer

GUARD_S = 10.0  # a recv waiting this long means the server did not close the connection
THREAD = "eventbus-metrics-connection"


class _Probe:
    """Live and ready; `live` blocks while `gate` is clear (a busy request)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)

    def live(self) -> Check:
        self.entered.release()
        assert self.gate.wait(GUARD_S)
        return True, "ok"

    def ready(self) -> Check:
        return True, "ok"


@pytest.fixture
def probe() -> _Probe:
    return _Probe()


@pytest.fixture
def start(probe: _Probe) -> Iterator[Callable[..., BoundedWSGIServer]]:
    servers: list[BoundedWSGIServer] = []

    def make(**options: float) -> BoundedWSGIServer:
        server = serve("127.0.0.1", 0, probe, **options)  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield make
    probe.gate.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def _connect(server: BoundedWSGIServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.server_port), timeout=GUARD_S)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes `sock` (True) or GUARD_S passes (TimeoutError)."""
    with sock:
        return sock.recv(1) == b""


def _get(server: BoundedWSGIServer, path: str = "/healthz") -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.server_port}{path}"
    with urllib.request.urlopen(url, timeout=GUARD_S) as resp:
        return resp.status, resp.read().decode()


def _threads() -> int:
    return sum(t.name == THREAD for t in threading.enumerate())


def _settles(predicate: Callable[[], bool]) -> None:
    """Poll `predicate` (thread state, which cannot be awaited) until true, within GUARD_S."""
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, "did not settle"
        time.sleep(0.01)


def test_idle_connections_are_closed_after_the_deadline(start: Callable[..., Any]) -> None:
    server = start(idle_timeout_s=0.5)
    idle = [_connect(server) for _ in range(5)]
    half = _connect(server)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a request that never ends
    assert all(_closed_by_server(sock) for sock in [*idle, half])
    _settles(lambda: _threads() == 0)  # every connection's thread ended with it
    assert _get(server) == (200, "ok\n")


def test_idle_connections_give_way_and_threads_stay_bounded(start: Callable[..., Any]) -> None:
    server = start(idle_timeout_s=60.0, max_connections=4)
    idle = [_connect(server) for _ in range(20)]
    # each connection beyond 4 evicted the oldest idle one, long before the 60 s deadline
    assert all(_closed_by_server(sock) for sock in idle[:16])
    _settles(lambda: _threads() == 4)
    assert _get(server) == (200, "ok\n")  # a probe still answers: it evicted idle[16]
    assert _closed_by_server(idle[16])
    _settles(lambda: _threads() == 3)  # the probe's connection ended: its slot is free
    idle.append(_connect(server))  # takes it
    assert _get(server, "/readyz") == (200, "ok\n")  # evicts idle[17]
    assert _closed_by_server(idle[17])
    _settles(lambda: _threads() == 3)
    for sock in idle[18:]:
        sock.close()
    _settles(lambda: _threads() == 0)


def test_a_connection_beyond_busy_ones_is_closed_unanswered(
    start: Callable[..., Any], probe: _Probe, caplog: pytest.LogCaptureFixture
) -> None:
    server = start(idle_timeout_s=60.0, max_connections=2)
    probe.gate.clear()  # /healthz requests block in the probe: their connections are busy
    busy = [_connect(server) for _ in range(2)]
    for sock in busy:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    for _ in busy:
        assert probe.entered.acquire(timeout=GUARD_S)  # both requests are being answered
    with caplog.at_level(logging.WARNING, logger="eventbus.ops.http_server"):
        assert _closed_by_server(_connect(server))
    assert "all 2 connections busy" in caplog.text
    probe.gate.set()
    for sock in busy:
        with sock:
            assert sock.recv(1024).startswith(b"HTTP/1.0 200")
    assert _get(server, "/readyz") == (200, "ok\n")


@pytest.mark.parametrize(
    ("options", "message"),
    [({"idle_timeout_s": 0}, "idle_timeout_s"), ({"max_connections": 0}, "max_connections")],
)
def test_bad_limits_are_refused(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BoundedWSGIServer(("127.0.0.1", 0), **options)  # type: ignore[arg-type]
