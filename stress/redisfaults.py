"""Redis-side faults of the chaos harness, on whatever deployment the run has (topology.py).

* ``redis-restart``: the target node (the server; the current primary; on a Cluster the node of
  the coordination hashtag, every other time another primary) stopped, alternately SIGTERM and
  SIGKILL, and started again on its AOF;
* ``client-kill``: ``CLIENT KILL TYPE normal`` on the target (on a Cluster: on every primary),
  and in turn ``CLIENT KILL ID`` of one client of the target;
* ``client-pause``: ``CLIENT PAUSE`` of the target, alternately 0.5 and 1.5 x the liveness TTL
  (on a Cluster every other two pauses hit another primary than the hashtag's);
* ``failover`` (Sentinel): the current primary SIGKILLed, the sentinels promote a replica, the
  killed node comes back as a replica of the new one;
* ``cluster-failover`` (Cluster with replicas): a primary SIGKILLed, its replica promoted, the
  killed node back as a replica; the first one and every other one after it is the primary
  holding the coordination hashtag, the others a primary holding only shard streams.

Restarts and failovers take seconds (an AOF to load, an election, a full sync): they run in a
worker thread so that the harness goes on (ends other faults on time, replaces consumers). One
Redis-side fault at a time: another waits until the running one is over (`busy`).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import redis
from topology import node_client

if TYPE_CHECKING:
    from chaos import Chaos
    from ledger import Ledgers

REDIS_KINDS = ("redis-restart", "client-kill", "client-pause", "failover", "cluster-failover")
SLOW = ("redis-restart", "failover", "cluster-failover")


class RedisFaults:
    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos
        self.top = chaos.top
        self.counts: dict[str, int] = defaultdict(int)
        self.worker: threading.Thread | None = None
        self.paused_until_ns = 0  # end of our last CLIENT PAUSE

    def busy(self) -> bool:
        return (self.worker is not None and self.worker.is_alive()) or (
            time.time_ns() < self.paused_until_ns
        )

    def inject(self, kind: str) -> dict[str, Any] | None:
        """Start a fault of `kind`; None while another Redis-side fault runs (retry later)."""
        if self.busy():
            return None
        n = self.counts[kind]
        self.counts[kind] += 1
        fault: dict[str, Any] = {"kind": kind, "t_ns": time.time_ns()}
        if kind == "client-kill":
            return fault | self._client_kill(n)
        if kind == "client-pause":
            return fault | self._client_pause(n)
        if kind == "redis-restart":
            kill = n % 2 == 1
            port = self._pick(n // 2)
            fault |= {"node": port, "detail": ("SIGKILL" if kill else "SIGTERM")}
            self._in_worker(fault, lambda: self.top.restart(port, kill))
        else:  # failover, cluster-failover
            port = self._pick(n) if kind == "cluster-failover" else self.top.target()
            fault |= {"node": port, "detail": f"SIGKILL primary {port}",
                      "hashtag_node": port == self.top.target()}  # fmt: skip
            self._in_worker(fault, lambda: fault.update(self.top.fail_over(port)))
        return fault

    def _pick(self, n: int) -> int:
        """The target node for even `n`, another primary for odd `n` (if there is one)."""
        target = self.top.target()
        others = [p for p in self.top.primaries() if p != target]
        return self.chaos.rng.choice(others) if n % 2 and others else target

    def _in_worker(self, fault: dict[str, Any], action: Any) -> None:
        def run() -> None:
            try:
                action()
            except Exception as exc:  # recorded: fails the run's no_crash_or_hang check
                fault["error"] = f"{type(exc).__name__}: {exc}"
                self.chaos.incidents.append({"kind": f"{fault['kind']} failed",
                                             "error": traceback.format_exc()[-3000:]})  # fmt: skip
            fault["end_ns"] = time.time_ns()
            took = (fault["end_ns"] - fault["t_ns"]) / 1e9
            extra = {k: fault[k] for k in ("new_primary", "promoted_s") if k in fault}
            print(f"    {fault['kind']} of {fault.get('node')} over in {took:.1f} s {extra}",
                  flush=True)  # fmt: skip

        self.worker = threading.Thread(target=run, name=f"chaos-{fault['kind']}", daemon=True)
        self.worker.start()

    def _client_kill(self, n: int) -> dict[str, Any]:
        target = self.top.target()
        if n % 2 == 0:
            killed = 0
            for port in self.top.primaries() if self.top.cluster else [target]:
                with node_client(port) as r:
                    kill = r.client_kill_filter
                    killed += int(self.chaos._redis(lambda kill=kill: kill(_type="normal")))
            where = "every primary" if self.top.cluster else f"node {target}"
            return {"killed": killed, "node": target,
                    "detail": f"TYPE normal on {where}: {killed} killed"}  # fmt: skip
        with node_client(target) as r:
            me = self.chaos._redis(r.client_id)
            deadline = time.monotonic() + 10
            while True:  # after a restart the clients may not have reconnected yet
                ids = [c["id"] for c in self.chaos._redis(r.client_list)
                       if int(c["id"]) != me and c.get("flags") != "S"]  # fmt: skip
                if ids or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            victim = self.chaos.rng.choice(ids) if ids else None
            killed = self.chaos._redis(lambda: r.client_kill_filter(_id=victim)) if victim else 0
        return {"t_ns": time.time_ns(), "killed": killed, "node": target,
                "detail": f"ID {victim} on node {target}: {killed} killed"}  # fmt: skip

    def _client_pause(self, n: int) -> dict[str, Any]:
        ms = int((0.5 if n % 2 == 0 else 1.5) * self.chaos.plan.ttl_s * 1000)
        port = self._pick(n // 2) if self.top.cluster else self.top.target()
        t = time.time_ns()
        with node_client(port) as r:
            self.chaos._redis(lambda: r.client_pause(ms))
        self.paused_until_ns = t + ms * 1_000_000
        return {"t_ns": t, "end_ns": t + ms * 1_000_000, "node": port,
                "detail": f"CLIENT PAUSE {ms} ms"}  # fmt: skip


def retryable() -> tuple[type[Exception], ...]:
    """Errors of the control client while Redis restarts or fails over."""
    from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError

    return (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ClusterDownError,
            TryAgainError, ReadOnlyError)  # fmt: skip


def failover_facts(led: Ledgers, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """What the failovers cost: promotion times, and the acknowledged publishes lost (never
    handled, not dead-lettered) by when they were acknowledged relative to the nearest earlier
    failover: a loss of asynchronous replication falls just before a kill."""
    kills = sorted(f["t_ns"] for f in faults if f["kind"] in ("failover", "cluster-failover"))
    handled = {(h.resource, h.seq) for h in led.handlings if h.ok}
    lost_before: list[float] = []
    for p in led.published:
        if (p.resource, p.seq) in handled or "p" in p.flags:  # poison: dead-lettered
            continue
        after = [k for k in kills if k >= p.acked_ns]
        if after:
            lost_before.append((after[0] - p.acked_ns) / 1e9)
    promoted = [f["promoted_s"] for f in faults if "promoted_s" in f]
    return {
        "failover_promoted_s": promoted,
        "failover_rejoined_s": [f["rejoined_s"] for f in faults if "rejoined_s" in f],
        "lost_acked_before_a_failover": len(lost_before),
        "lost_acked_within_1s_before_a_failover": sum(1 for x in lost_before if x <= 1.0),
    }
