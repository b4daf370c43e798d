"""The chaos harness's fault-injecting TCP proxy (``stress/proxy.py``) against a real Redis."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from localredis.server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"stress_{name}", ROOT / "stress" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


proxy = _load("proxy")


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def hub() -> Iterator[object]:
    h = proxy.ProxyHub()
    yield h
    h.close()


def _client(port: int, timeout: float = 10) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )  # no transparent retries, as eventbus


def _timed(fn: object) -> float:
    t = time.monotonic()
    fn()  # type: ignore[operator]
    return time.monotonic() - t


def test_plain_pipe_and_latency(server: RedisServer, hub: object) -> None:
    link = hub.start(server.port)  # type: ignore[attr-defined]
    r = _client(link.port)
    assert r.ping()
    r.set("k", "v" * 100_000)
    assert r.get("k") == b"v" * 100_000
    link.set(up_ms=100, down_ms=50)
    assert 0.15 <= _timed(r.ping) < 1.0
    link.set(down_bps=200_000)  # slow reads: 100 kB take about half a second
    assert 0.35 <= _timed(lambda: r.get("k")) < 2.0
    link.clear()
    assert _timed(r.ping) < 0.1
    r.close()


def test_spike_delays_only_what_is_sent_during_it(server: RedisServer, hub: object) -> None:
    link = hub.start(server.port)  # type: ignore[attr-defined]
    a, b = _client(link.port), _client(link.port)
    assert a.ping() and b.ping()
    link.spike(up_ms=800, for_s=0.2)
    assert 0.7 <= _timed(a.ping) < 1.5
    assert _timed(b.ping) < 0.2  # sent after the spike, on another connection


def test_blackhole_holds_and_delivers_late(server: RedisServer, hub: object) -> None:
    link = hub.start(server.port)  # type: ignore[attr-defined]
    direct = _client(server.port)
    direct.delete("late")
    r = _client(link.port, timeout=0.3)
    assert r.ping()
    link.blackhole()
    with pytest.raises(redis.TimeoutError):  # the client gives up; its request is held
        r.incr("late")
    assert direct.get("late") is None
    assert link.stats()["open"] >= 1  # no RST: the connection is still open
    fresh = _client(link.port, timeout=0.3)
    with pytest.raises(redis.TimeoutError):  # new connections are accepted, then held too
        fresh.ping()
    link.heal()
    deadline = time.monotonic() + 3
    while direct.get("late") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert direct.get("late") == b"1"  # the request landed after the heal
    assert _client(link.port).ping()


def test_blackhole_healed_with_drop_closes_connections(server: RedisServer, hub: object) -> None:
    link = hub.start(server.port)  # type: ignore[attr-defined]
    direct = _client(server.port)
    direct.delete("dropped")
    r = _client(link.port, timeout=5)
    assert r.ping()
    link.blackhole()
    errors: list[Exception] = []

    def call() -> None:
        try:
            r.incr("dropped")
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)
    link.heal(drop=True)
    t.join(5)
    assert errors and isinstance(errors[0], redis.ConnectionError)
    time.sleep(0.2)
    assert direct.get("dropped") is None  # the held request was dropped with its connection
    assert _client(link.port).ping()


def test_redis_down_closes_the_client(hub: object) -> None:
    with RedisServer() as s:
        port = s.port
        link = hub.start(port)  # type: ignore[attr-defined]
        assert _client(link.port).ping()
    with pytest.raises(redis.ConnectionError):
        _client(link.port, timeout=2).ping()
