"""The Redis deployment of a chaos run, behind one interface: `Single` (one ``redis-server``),
`Sentinel` (a primary, two replicas, three sentinels: chosen when ``failover`` is among the
fault kinds) and `Cluster` (3 primaries, with one replica each for ``cluster-failover``), all on
loopback (`localredis.server`, `localredis.cluster`).

What the harness needs from a deployment: start and stop it; the connection settings of a client
process (directly, or through that process's `links.ClientLinks`); a control client for its
own reads (progress, drain, dead letters), which follows failovers; the node Redis-side faults
target (`target`: the server, the current primary, the node of the coordination hashtag); and
the faults themselves: `restart` a node (AOF reload) and `fail_over` (SIGKILL a primary, wait
until a replica serves in its place, bring the killed node back as a replica).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from redis.cluster import RedisCluster

from eventbus.protocol.keys import Keys
from localredis.cluster import ReplicatedCluster
from localredis.sentinel import RedisSentinel
from localredis.server import RedisServer

if TYPE_CHECKING:
    from links import ClientLinks

CONTROL = {"socket_timeout": 30, "socket_connect_timeout": 2}
HASHTAG_KEY = Keys().topics()  # a key under the coordination hashtag ({eventbus})


def node_client(port: int, timeout: float = 10) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=timeout, socket_connect_timeout=2)


def _forget_data(node: RedisServer) -> None:
    """Remove a stopped node's AOF: it comes back as a replica and full-syncs anyway (loading
    an AOF it is about to discard only delays that)."""
    shutil.rmtree(node.dir / "appendonlydir", ignore_errors=True)


class Topology:
    kind = ""
    nodes: list[RedisServer]
    sentinel_ports: ClassVar[list[int]] = []  # instances of Sentinel set their own
    cluster = False

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop everything and remove the servers' folders."""
        self.stop()
        for n in self.nodes:
            if n._tmp is not None:
                n._tmp.cleanup()

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def client_settings(self, links: ClientLinks | None) -> dict[str, Any]:
        """Connection settings of a client process (through `links` when given)."""
        raise NotImplementedError

    def control(self) -> Any:
        """A sync client for the harness's own commands, following failovers."""
        raise NotImplementedError

    def target(self) -> int:
        """Port of the node Redis-side faults target by default."""
        raise NotImplementedError

    def primaries(self) -> list[int]:
        return [self.target()]

    def restart(self, port: int, kill: bool) -> None:
        """Stop the node on `port` (SIGTERM or SIGKILL) and start it again on its AOF; return
        once the deployment is whole again."""
        raise NotImplementedError

    def fail_over(self, port: int | None = None) -> dict[str, Any]:
        raise NotImplementedError(f"no failover on a {self.kind} deployment")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "nodes": [n.port for n in self.nodes],
                "sentinels": self.sentinel_ports}  # fmt: skip

    def promotions(self) -> list[str]:
        """Log lines of every promotion of a replica (planned or not)."""
        return []

    def _log_lines(self, procs: list[RedisServer], marker: str) -> list[str]:
        out = []
        for n in procs:
            log = n.dir / "redis.log"
            if log.exists():
                text = log.read_text(errors="replace")
                out += [f"{n.port}: {line}" for line in text.splitlines() if marker in line]
        return out

    def save_logs(self, dest: Path) -> None:
        """Copy every server's log into `dest` (evidence: promotions, syncs, restarts)."""
        for n in self.nodes:
            if (n.dir / "redis.log").exists():
                shutil.copy(n.dir / "redis.log", dest / f"redis-{n.port}.log")


class Single(Topology):
    kind = "single"

    def __init__(self, appendonly: str | None) -> None:
        self.server = RedisServer(appendonly=appendonly)
        self.nodes = [self.server]

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def client_settings(self, links: ClientLinks | None) -> dict[str, Any]:
        port = links.port(self.server.port) if links else self.server.port
        return {"redis_url": f"redis://127.0.0.1:{port}/0"}

    def control(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, **CONTROL)

    def target(self) -> int:
        return self.server.port

    def restart(self, port: int, kill: bool) -> None:
        self.server.restart(kill=kill)


class Sentinel(Topology):
    kind = "sentinel"

    def __init__(self, appendonly: str | None, down_after_ms: int) -> None:
        self.top = RedisSentinel(
            replicas=2, sentinels=3, down_after_ms=down_after_ms, appendonly=appendonly,
            failover_timeout_ms=max(5000, 3 * down_after_ms),
        )  # fmt: skip
        self.nodes = self.top.nodes
        self.sentinel_ports = [s.port for s in self.top.sentinels]

    def start(self) -> None:
        self.top.start(timeout=60)

    def stop(self) -> None:
        self.top.stop()

    def save_logs(self, dest: Path) -> None:
        super().save_logs(dest)
        for s in self.top.sentinels:
            if (s.dir / "redis.log").exists():
                shutil.copy(s.dir / "redis.log", dest / f"sentinel-{s.port}.log")

    def close(self) -> None:
        self.top.__exit__()

    def promotions(self) -> list[str]:
        return self._log_lines(self.top.sentinels[:1], "+switch-master")

    def client_settings(self, links: ClientLinks | None) -> dict[str, Any]:
        ports = [links.port(p) if links else p for p in self.sentinel_ports]
        return {"sentinels": ",".join(f"127.0.0.1:{p}" for p in ports),
                "sentinel_service": self.top.service}  # fmt: skip

    def control(self) -> redis.Redis:
        sentinel = redis.Sentinel([("127.0.0.1", p) for p in self.sentinel_ports],
                                  sentinel_kwargs={"socket_timeout": 2})  # fmt: skip
        return sentinel.master_for(self.top.service, **CONTROL)  # type: ignore[no-any-return]

    def target(self) -> int:
        return self.top.primary_port

    def restart(self, port: int, kill: bool) -> None:
        node = self.node(port)
        node.stop(kill=kill)
        if port == self.top.primary_port:  # back as the primary it was (sentinels saw no gap)
            extra = node.extra
            if "--replicaof" in extra:
                i = extra.index("--replicaof")
                del extra[i : i + 3]
            node.start(timeout=120)  # answers PING once its AOF is loaded
            self.top.wait_settled(120)  # and the replicas have synced with it again
        else:
            self.top.restart(port, timeout=120)

    def fail_over(self, port: int | None = None) -> dict[str, Any]:
        """SIGKILL the primary; the sentinels promote a replica; the killed node comes back as
        a replica of the new primary (its AOF removed: it full-syncs)."""
        old = self.top.primary_port
        t = time.monotonic()
        new = self.top.failover(kill=True, timeout=120)
        promoted_s = time.monotonic() - t
        _forget_data(self.node(old))
        self.top.restart(old, timeout=120)
        return {"old_primary": old, "new_primary": new, "promoted_s": round(promoted_s, 3),
                "rejoined_s": round(time.monotonic() - t, 3)}  # fmt: skip


class Cluster(Topology):
    kind = "cluster"
    cluster = True

    def __init__(self, appendonly: str | None, replicas: int, node_timeout_ms: int) -> None:
        self.top = ReplicatedCluster(3, replicas, node_timeout_ms=node_timeout_ms)
        for n in self.top.nodes:
            n.appendonly = appendonly
        self.nodes = self.top.nodes
        self.replicas = replicas

    def start(self) -> None:
        self.top.__enter__()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop(kill=True)

    def close(self) -> None:
        self.top.__exit__()

    def promotions(self) -> list[str]:
        return self._log_lines(self.nodes, "Failover election won")

    def client_settings(self, links: ClientLinks | None) -> dict[str, Any]:
        first = self.nodes[0].port
        port = links.port(first) if links else first
        return {"redis_url": f"redis://127.0.0.1:{port}/0", "cluster": True}

    def control(self) -> RedisCluster:
        live = next(n.port for n in self.nodes if n.proc is not None)
        return RedisCluster(host="127.0.0.1", port=live, **CONTROL)

    def target(self) -> int:
        """The primary holding the coordination hashtag."""
        return self.top.primary_of(HASHTAG_KEY)

    def primaries(self) -> list[int]:
        return self.top.primary_ports()

    def restart(self, port: int, kill: bool) -> None:
        node = self.node(port)
        node.stop(kill=kill)
        node.start(timeout=120)
        self.top.wait_ok(120)

    def fail_over(self, port: int | None = None) -> dict[str, Any]:
        """SIGKILL primary `port` (default: the hashtag's); its replica takes its slots; the
        killed node comes back as that replica's replica (its AOF removed: it full-syncs)."""
        old = port or self.target()
        t = time.monotonic()
        new = self.top.failover(old, kill=True, timeout=120)
        promoted_s = time.monotonic() - t
        _forget_data(self.node(old))
        self.node(old).start(timeout=120)
        self.top.wait_ok(120)
        return {"old_primary": old, "new_primary": new, "promoted_s": round(promoted_s, 3),
                "rejoined_s": round(time.monotonic() - t, 3)}  # fmt: skip


def make(kinds: list[str], cluster: bool, appendonly: str | None, down_after_ms: int,
         node_timeout_ms: int) -> Topology:  # fmt: skip
    """The deployment a run's fault kinds need."""
    if cluster or "cluster-failover" in kinds:
        replicas = 1 if "cluster-failover" in kinds else 0
        return Cluster(appendonly, replicas, node_timeout_ms)
    if "failover" in kinds:
        return Sentinel(appendonly, down_after_ms)
    return Single(appendonly)
