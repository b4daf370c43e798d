"""A private Redis Sentinel topology on loopback: a primary, its replicas and sentinels
(``redis-server --sentinel``), for tests, the chaos harness's ``failover`` kind and benchmarks.
Needs the ``redis-server`` binary (Debian package ``redis-server``) on PATH.
"""

from __future__ import annotations

import time
from typing import Any

from eventbus.errors import EventBusError
from localredis.server import RedisServer, redis_binary

SENTINEL_SERVICE = "eventbus"
"""Master name the `RedisSentinel` topology's sentinels monitor."""


def _sentinel_masters(port: int, timeout: float = 0.5) -> dict[str, dict[str, Any]]:
    """``SENTINEL MASTERS`` of the sentinel on `port` ({} when it does not answer)."""
    import redis

    try:
        with redis.Redis(port=port, socket_timeout=timeout, socket_connect_timeout=timeout) as r:
            return dict(r.sentinel_masters())
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return {}


class _SentinelProcess(RedisServer):
    """One sentinel of a `RedisSentinel` topology (``redis-server sentinel.conf --sentinel``)."""

    def __init__(self, topology: RedisSentinel) -> None:
        super().__init__()
        self.topology = topology

    def args(self) -> list[str]:
        return self.topology.sentinel_args(self)


class RedisSentinel:
    """A primary, `replicas` replicas and `sentinels` sentinels on free loopback ports; a context
    manager. Sentinels are ``redis-server --sentinel`` (no extra package), each with its own
    config file in its own temporary folder (a sentinel rewrites its config).

    `down_after_ms` is ``sentinel down-after-milliseconds``: how long the primary must be silent
    before a failover starts (Sentinel's default is 30 s; tests want it short). `failover()` kills
    the current primary and waits until every sentinel names a promoted replica that answers as
    a primary.
    """

    def __init__(
        self,
        replicas: int = 2,
        sentinels: int = 3,
        *,
        service: str = SENTINEL_SERVICE,
        down_after_ms: int = 500,
        failover_timeout_ms: int = 5000,
        appendonly: str | None = None,
    ) -> None:
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        common = [
            # full syncs at once over the socket (the default waits 5 s for more replicas)
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            "--repl-ping-replica-period", "1",
        ]  # fmt: skip
        self.nodes = [RedisServer(appendonly=appendonly, extra=list(common))]
        primary = self.nodes[0].port
        self.nodes += [
            RedisServer(
                appendonly=appendonly, extra=[*common, "--replicaof", "127.0.0.1", str(primary)]
            )
            for _ in range(replicas)
        ]
        self.sentinels = [_SentinelProcess(self) for _ in range(sentinels)]
        self.quorum = sentinels // 2 + 1
        self.primary_port = primary

    # -- addresses ------------------------------------------------------------------------------
    @property
    def sentinel_addresses(self) -> str:
        """``host:port,host:port,...`` of the sentinels: the form `Settings.sentinels` takes."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def url(self) -> str:
        """URL of the current primary (as last seen by `wait_primary` or `failover`)."""
        return f"redis://127.0.0.1:{self.primary_port}/0"

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    @property
    def primary(self) -> RedisServer:
        return self.node(self.primary_port)

    def sentinel_args(self, sentinel: RedisServer) -> list[str]:
        """Command line of `sentinel`, after writing its config file (the primary is the first
        node: a restarted sentinel finds the current one in its rewritten config)."""
        conf = sentinel.dir / "sentinel.conf"
        if conf.exists():
            return [redis_binary(), str(conf), "--sentinel"]
        conf.write_text(
            f"port {sentinel.port}\n"
            "bind 127.0.0.1\n"
            "protected-mode no\n"
            f"dir {sentinel.dir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.nodes[0].port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.service} {max(1, len(self.nodes) - 1)}\n"
        )
        return [redis_binary(), str(conf), "--sentinel"]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> RedisSentinel:
        """Start every process and wait (at most `timeout` s) until the replicas are in sync and
        every sentinel knows the primary, its replicas and the other sentinels."""
        for node in self.nodes:
            node.start()
        for s in self.sentinels:
            s.start()
        self.wait_settled(timeout)
        return self

    def _settled(self) -> bool:
        """Whether every sentinel names the same primary, sees it up, knows the other sentinels
        and the replicas, and that primary has every other live node as an online replica. Then
        `primary_port` is that primary (an unplanned failover, e.g. of a primary too slow to
        answer on a loaded machine, is followed rather than waited out)."""
        ports = set()
        for s in self.sentinels:
            state = _sentinel_masters(s.port).get(self.service)
            if (
                state is None
                or state["is_sdown"]
                or state["is_odown"]
                or "failover_in_progress" in str(state["flags"])
                or int(state["num-other-sentinels"]) < len(self.sentinels) - 1
            ):
                return False
            ports.add(int(state["port"]))
        if len(ports) != 1:
            return False
        port = ports.pop()
        if not self._replicas_synced(port):
            return False
        self.primary_port = port
        return True

    def _replicas_synced(self, port: int) -> bool:
        """Whether `port` answers as a primary and every other live node is its online
        replica."""
        import redis

        try:
            with redis.Redis(port=port, socket_timeout=0.5) as r:
                info = r.info("replication")
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        if info.get("role") != "master":
            return False
        online = sum(
            1
            for k, v in info.items()
            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
        )
        return online >= sum(1 for n in self.nodes if n.proc is not None and n.port != port)

    def _roles(self) -> dict[int, Any]:
        import redis

        roles: dict[int, Any] = {}
        for n in self.nodes:
            try:
                with redis.Redis(port=n.port, socket_timeout=0.5) as r:
                    roles[n.port] = r.execute_command("ROLE")
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                roles[n.port] = f"{type(exc).__name__}: {exc}"
        return roles

    def _states(self) -> dict[int, dict[str, Any] | None]:
        return {s.port: _sentinel_masters(s.port).get(self.service) for s in self.sentinels}

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Wait until the topology is stable (see `_settled`); `primary_port` is then its
        primary."""
        deadline = time.monotonic() + timeout
        while not self._settled():
            if time.monotonic() > deadline:
                raise EventBusError(
                    f"Sentinel topology did not settle within {timeout} s around primary "
                    f"{self.primary_port}: sentinels {self._states()}; nodes {self._roles()}"
                )
            time.sleep(0.05)

    def wait_primary(self, not_port: int | None = None, timeout: float = 30.0) -> int:
        """Wait until every sentinel names the same primary (other than `not_port`) and it
        answers with role master; remember and return its port."""
        import redis

        deadline = time.monotonic() + timeout
        while True:
            ports = {int(st["port"]) if st else None for st in self._states().values()}
            port = ports.pop() if len(ports) == 1 else None
            if port is not None and port != not_port:
                try:
                    with redis.Redis(port=port, socket_timeout=0.5) as r:
                        if r.info("replication").get("role") == "master":
                            self.primary_port = port
                            return port
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
            if time.monotonic() > deadline:
                raise EventBusError(f"no promoted primary within {timeout} s")
            time.sleep(0.02)

    def failover(self, kill: bool = True, timeout: float = 30.0) -> int:
        """Fail the primary over and return the new primary's port: SIGKILL it (`kill`, the
        default) or ask a sentinel (``SENTINEL FAILOVER``: the old primary becomes a replica).
        Waits until every sentinel names a new primary that answers as one. A killed primary
        stays down until `restart_old` brings it back (as a replica of the new one)."""
        import redis

        old = self.primary_port
        if kill:
            self.primary.stop(kill=True)
        else:
            with redis.Redis(port=self.sentinels[0].port, socket_timeout=5) as r:
                r.execute_command("SENTINEL", "FAILOVER", self.service)
        return self.wait_primary(not_port=old, timeout=timeout)

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start the stopped node on `port` again, as a replica of the current primary, and wait
        until it is an online replica that every sentinel knows. (Sentinel would convert a
        returning old primary itself, but only about 8 s after it reappears, during which it
        accepts writes as a primary.)"""
        node = self.node(port)
        extra = node.extra
        if "--replicaof" in extra:
            i = extra.index("--replicaof")
            del extra[i : i + 3]
        extra += ["--replicaof", "127.0.0.1", str(self.primary_port)]
        node.start()
        self.wait_settled(timeout)

    def stop(self) -> None:
        for proc in (*self.sentinels, *self.nodes):
            proc.stop(kill=True)

    def __enter__(self) -> RedisSentinel:
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for proc in (*self.sentinels, *self.nodes):
            if proc._tmp is not None:
                proc._tmp.cleanup()
