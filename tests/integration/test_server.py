"""`eventbus.testing.server.RedisServer`, as far as the fixtures rely on it."""

from __future__ import annotations

import pytest
import redis

from eventbus.errors import EventBusError
from eventbus.testing.server import RedisServer, free_port


def test_server_starts_answers_and_stops() -> None:
    with RedisServer() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
            assert client.info("server")["tcp_port"] == server.port
        proc = server.proc
    assert proc is not None and proc.poll() is not None  # stopped on exit
    with pytest.raises(redis.ConnectionError), redis.Redis(port=server.port) as client:
        client.ping()


def test_restart_keeps_port_and_aof_data() -> None:
    with RedisServer(appendonly="always") as server:
        with redis.Redis.from_url(server.url) as client:
            client.xadd("s", {"k": "v"})
        server.restart(kill=True)
        with redis.Redis.from_url(server.url) as client:
            assert client.xlen("s") == 1


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EventBusError, match="redis-server not found"):
        RedisServer().start()


def test_free_port_is_bindable_and_below_the_limit() -> None:
    assert free_port(below=55536) < 55536
