"""A Redis Cluster with replicas on loopback, for failover and resharding tests.

`ReplicatedCluster(3, 1)` starts 6 ``redis-server`` processes (3 primaries, one replica each,
``redis-cli --cluster create ... --cluster-replicas 1``) with a short ``cluster-node-timeout``
so that a killed primary's replica is promoted within a few seconds. `failover` kills a primary
(or asks its replica for ``CLUSTER FAILOVER``) and waits until the replica serves its slots;
`move_slot` migrates one slot between primaries the way ``redis-cli --cluster reshard`` does
(``SETSLOT IMPORTING/MIGRATING``, ``MIGRATE`` key by key, ``SETSLOT NODE``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection
from typing import Any

from eventbus.errors import EventBusError
from localredis.server import RedisServer, bindable, ephemeral_low, free_port, redis_binary

_BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000 (Redis's default)


def cluster_port(taken: Collection[int] = ()) -> int:
    """A loopback port for a cluster node whose cluster-bus port (port + 10000) is free too,
    both below the kernel's ephemeral range (see `free_port`) and neither in `taken` (the
    ports and bus ports of the cluster's other nodes, which are not bound yet)."""
    while True:
        port = free_port(below=ephemeral_low() - _BUS_OFFSET)
        bus = port + _BUS_OFFSET
        if port not in taken and bus not in taken and bindable(bus):
            return port


def _client(port: int) -> Any:
    import redis

    return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1)


def _raw(reply: Any) -> bytes:
    return reply if isinstance(reply, bytes) else str(reply).encode()


def _wait(ready: Callable[[], bool], timeout: float, error: str, poll_s: float = 0.1) -> None:
    """Poll `ready()` until it is true; raises `EventBusError(error)` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise EventBusError(error)
        time.sleep(poll_s)


_View = tuple[tuple[bytes, ...], ...]
"""A node's view of the cluster (`_view`)."""


def _view(port: int) -> _View:
    """Node `port`'s view of the cluster: (node ID, config epoch, slot ranges...) per primary,
    sorted (``CLUSTER NODES`` fields 0, 6 and 8 on; replicas and flags left out)."""
    with _client(port) as r:
        lines = _raw(r.execute_command("CLUSTER", "NODES")).splitlines()
    rows = (line.split() for line in lines)
    return tuple(sorted((f[0], f[6], *f[8:]) for f in rows if b"master" in f[2]))


def _owner(view: _View, slot: int) -> bytes | None:
    """The node ID owning `slot` in `view` (`_view`), or None."""
    for node_id, _epoch, *ranges in view:
        for r in ranges:
            if r.startswith(b"["):  # "[slot->-node]" / "[slot-<-node]": migration in progress
                continue
            start, _, end = r.partition(b"-")
            if int(start) <= slot <= int(end or start):
                return node_id
    return None


class ReplicatedCluster:
    """`primaries` primaries with `replicas` replicas each on loopback; a context manager."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.primaries_wanted = primaries
        self._url = ""
        self.replicas = replicas
        extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        self.nodes: list[RedisServer] = []
        for _ in range(primaries * (1 + replicas)):
            self.nodes.append(RedisServer(cluster_port(self._ports()), extra=list(extra)))

    @property
    def url(self) -> str:
        """URL of a primary as of the start (any node serves as a Cluster client's seed)."""
        return self._url

    def _ports(self, but: RedisServer | None = None) -> set[int]:
        """The ports and cluster-bus ports of the nodes (all but `but`)."""
        return {p for n in self.nodes if n is not but for p in (n.port, n.port + _BUS_OFFSET)}

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]

    def _role(self, port: int) -> str | None:
        try:
            with _client(port) as r:
                return str(r.info("replication")["role"])
        except Exception:
            return None

    def primary_ports(self) -> list[int]:
        """Ports of the live primaries that serve slots (as the live nodes see it)."""
        ports: set[int] = set()
        for n in self._live():
            try:
                with _client(n.port) as r:
                    rows = r.execute_command("CLUSTER", "SLOTS")
            except Exception:
                continue
            ports |= {int(row[2][1]) for row in rows}
        return sorted(p for p in ports if self._role(p) == "master")

    def primary_of(self, key: str) -> int:
        """Port of the primary serving `key`'s slot."""
        port = self._live()[0].port
        with _client(port) as r:
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        raise EventBusError(f"slot of {key} not served")

    def replica_of(self, primary: int) -> int:
        with _client(primary) as r:
            info = r.info("replication")
        return int(info["slave0"]["port"])

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> ReplicatedCluster:
        try:
            for node in self.nodes:
                self._start(node)
            subprocess.run(
                [
                    redis_binary("redis-cli"), "--cluster", "create",
                    *[f"127.0.0.1:{n.port}" for n in self.nodes],
                    "--cluster-replicas", str(self.replicas), "--cluster-yes",
                ],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self.wait_ok()
            self._url = f"redis://127.0.0.1:{self.primary_ports()[0]}/0"
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, node: RedisServer, attempts: int = 5) -> None:
        """Start `node`, on another port if something else took its port or bus port since
        they were chosen (possible only before the cluster is created)."""
        for attempt in range(attempts):
            try:
                node.start()
                return
            except EventBusError as exc:
                if "Address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                (node.dir / "nodes.conf").unlink(missing_ok=True)  # written with the old port
                node.port = cluster_port(self._ports(but=node))

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok``, `primaries_wanted` primaries
        serve slots and every live replica's link to its primary is up."""
        _wait(self._ok, timeout, f"Redis Cluster not ok within {timeout} s")

    def _ok(self) -> bool:
        return (
            self._states_ok()
            and all(self._linked(n.port) for n in self._live())
            and len(self.primary_ports()) == self.primaries_wanted
        )

    def _linked(self, port: int) -> bool:
        """Node `port` is a primary, or a replica whose link to its primary is up."""
        try:
            with _client(port) as r:
                rep = r.info("replication")
        except Exception:
            return False
        return bool(rep["role"] != "slave" or rep.get("master_link_status") == "up")

    def failover(self, primary: int, kill: bool = True, timeout: float = 30.0) -> int:
        """Fail `primary` over to its replica: SIGKILL it (`kill`) or ``CLUSTER FAILOVER`` on
        the replica; wait until the replica serves the slots; return the replica's port. A
        killed primary stays down (`restart` brings it back as a replica)."""
        replica = self.replica_of(primary)
        if kill:
            self.node(primary).stop(kill=True)
        else:
            with _client(replica) as r:
                r.execute_command("CLUSTER", "FAILOVER")
        _wait(
            lambda: self._role(replica) == "master" and self._states_ok(),
            timeout,
            f"replica {replica} of {primary} not promoted within {timeout} s",
        )
        return replica

    def _states_ok(self) -> bool:
        """Every live node reports ``cluster_state:ok``."""
        try:
            for n in self._live():
                with _client(n.port) as r:
                    if b"cluster_state:ok" not in _raw(r.execute_command("CLUSTER", "INFO")):
                        return False
            return True
        except Exception:
            return False

    def move_slot(self, slot: int, source: int, target: int, batch: int = 100) -> int:
        """Migrate `slot` from primary `source` to primary `target` (as ``redis-cli --cluster
        reshard`` does); returns the keys moved. Raises `EventBusError` if the nodes do not all
        see `target` owning the slot within 30 s.

        ``SETSLOT NODE`` makes the importing target take the slot with an epoch bumped without
        consensus, but only when the target does not already believe its epoch is the greatest
        (Redis Cluster spec, "configEpoch conflicts"). A target that has not yet heard of a bump
        elsewhere keeps its epoch, and gossip from the source sent just before the source's own
        ``SETSLOT NODE`` (claiming the slot with a greater epoch) then takes the slot back: each
        side names the other as owner, and every command on the slot ends in redirections for
        good. So the move starts only once every node agrees on the epochs, and ``SETSLOT
        NODE`` goes to the target first, then the source, then the rest (the order the
        ``CLUSTER SETSLOT`` documentation asks for)."""
        self._wait_agreed(lambda views: len(set(views)) == 1, "agree on epochs and slots")
        src, dst = _client(source), _client(target)
        try:
            src_id = src.execute_command("CLUSTER", "MYID")
            dst_id = dst.execute_command("CLUSTER", "MYID")
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            moved = 0
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            others = [p for p in self.primary_ports() if p not in (source, target)]
            for port in (target, source, *others):
                with _client(port) as r:
                    r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        finally:
            src.close()
            dst.close()
        self._wait_agreed(
            lambda views: all(_owner(v, slot) == _raw(dst_id) for v in views),
            f"see slot {slot} on {target}",
        )
        return moved

    def _wait_agreed(
        self, agreed: Callable[[list[_View]], bool], what: str, timeout: float = 30.0
    ) -> None:
        """Wait until `agreed(views)` holds, a view being one live node's `_view`."""
        _wait(
            lambda: agreed([_view(n.port) for n in self._live()]),
            timeout,
            f"cluster nodes did not {what} within {timeout} s",
            poll_s=0.01,
        )

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop(kill=True)
            if node._tmp is not None:
                node._tmp.cleanup()
