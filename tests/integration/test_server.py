"""`localredis.server.RedisServer`, as far as the fixtures rely on it."""

from __future__ import annotations

import pytest
import redis

from eventbus.errors import EventBusError
from localredis.server import RedisServer, ephemeral_low, free_port


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


def test_free_port_is_below_the_limit_and_the_ephemeral_range() -> None:
    # a client socket's local port (ephemeral range) cannot be bound by a restarted server
    assert free_port(below=5000) < 5000
    assert all(free_port() < ephemeral_low() for _ in range(100))


def test_cluster_ports_avoid_each_other_and_the_ephemeral_range() -> None:
    from localredis.cluster import ReplicatedCluster

    cluster = ReplicatedCluster(3, 1)  # ports chosen, nothing started
    ports = [n.port for n in cluster.nodes]
    everything = ports + [p + 10000 for p in ports]
    assert len(set(everything)) == len(everything)  # no node's port is another's bus port
    assert max(everything) < ephemeral_low()  # the kernel never hands these out


def test_a_cluster_node_whose_bus_port_was_taken_starts_on_another_port() -> None:
    import socket

    from localredis.cluster import ReplicatedCluster

    cluster = ReplicatedCluster(3, 0)
    first = cluster.nodes[0].port
    with socket.socket() as squatter:  # something took node 0's bus port after the choice
        squatter.bind(("127.0.0.1", first + 10000))
        squatter.listen()
        with cluster:
            assert cluster.nodes[0].port != first
            assert len(cluster.primary_ports()) == 3
            with redis.Redis(port=cluster.nodes[0].port) as client:
                assert b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO")
