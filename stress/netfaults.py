"""Network faults of the chaos harness: every client process talks to Redis through its own
links (`proxy.Link`s, one per Redis address of the deployment: the server; every data node and
sentinel of a Sentinel deployment; every Cluster node; see links.py), so that a fault can target
one consumer or one publisher; one `ProxyHub` in a daemon thread of the harness runs them all.
A fault acts on all links of its client process at once.

Fault kinds:

* ``net-delay`` (a consumer's link): latency both ways with jitter and slow reads (the replies
  throttled to `SLOW_READ_BPS`) for 2.5 x TTL; every other time it starts with a delay spike:
  what the consumer sends in the first 0.6 x TTL reaches Redis 1.5 x TTL late (its heartbeat
  included), so its liveness expires while it still believes it holds its shards and its
  requests land after another consumer took them over: the lease must fence it.
* ``partition``, in turn: (0) a blackhole of a consumer's link for 1.5 x TTL + 0.5 s, then
  healed (what it sent meanwhile is delivered, late); (1) a blackhole of a publisher's link
  longer than ``publish_timeout_s`` (the publishes in flight raise PublishError: recorded as
  failed, not acknowledged, so not lost; they may still be stored when the link heals); (2) one
  shorter than ``publish_timeout_s`` (its publishes are late, not failed); (3) like (0), but the
  held connections are closed at the heal instead of delivered. The long one comes before the
  short one so that, in a short run, it still meets publishes in flight.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ledger import replicas_short
from links import ClientLinks
from proxy import ProxyHub

if TYPE_CHECKING:
    from chaos import Chaos, Plan
    from ledger import Ledgers

NET_KINDS = ("net-delay", "partition")
SLOW_READ_BPS = 128_000  # bytes/s a net-delayed consumer can read
BASE_DELAY_MS, JITTER_MS = 5.0, 10.0


class NetFaults:
    """The proxies of one run and the network faults injected through them."""

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos
        self.hub = ProxyHub()
        self.links: dict[str, ClientLinks] = {}
        self._counts: dict[str, int] = defaultdict(int)

    def settings(self, name: str) -> dict[str, Any]:
        """New proxies for the client process `name` (``con-<i>``, ``pub-<i>``), one per Redis
        address of the deployment (links.py): its connection settings."""
        top = self.chaos.top
        links = ClientLinks(self.hub, [n.port for n in top.nodes], top.sentinel_ports,
                            top.cluster, seed=self.chaos.plan.seed + len(self.links))  # fmt: skip
        self.links[name] = links
        return top.client_settings(links)

    def close(self) -> None:
        self.hub.close()

    def inject(self, kind: str) -> dict[str, Any] | None:
        """Start a fault of `kind` (its end is scheduled); None when no consumer can be the
        victim now (the caller retries)."""
        n = self._counts[kind]
        if kind == "partition" and n % 4 in (1, 2):
            self._counts[kind] += 1
            return self._partition_publisher(long=n % 4 == 1)
        victim = self.chaos._victim()
        if victim is None:
            return None
        self._counts[kind] += 1
        cid = victim.consumer_id
        assert cid is not None
        fault: dict[str, Any] = {
            "kind": kind,
            "victim": victim.index,
            "victim_id": cid,
            "victim_shards": self.chaos._held(cid),
        }
        link = self.links[f"con-{victim.index}"]
        ttl = self.chaos.plan.ttl_s
        if kind == "net-delay":
            link.set(
                up_ms=BASE_DELAY_MS,
                down_ms=BASE_DELAY_MS,
                jitter_ms=JITTER_MS,
                down_bps=SLOW_READ_BPS,
            )
            detail = (
                f"latency {BASE_DELAY_MS:g}+{JITTER_MS:g} ms, reads {SLOW_READ_BPS // 1000} kB/s"
            )
            if n % 2 == 0:
                spike_s, window_s = 1.5 * ttl, 0.6 * ttl
                link.spike(up_ms=spike_s * 1000, for_s=window_s)
                fault["spike_s"] = spike_s
                fault["expect_takeover"] = True  # its liveness expires: others take its shards
                detail += f", spike +{spike_s:g} s for what is sent in {window_s:g} s"
            duration = 2.5 * ttl
            end = link.clear
        else:
            drop = n % 4 == 3
            duration = 1.5 * ttl + 0.5
            link.blackhole()
            fault["blackhole_s"] = duration
            fault["expect_takeover"] = True
            fault["held"] = "dropped" if drop else "delivered"
            detail = f"blackhole {duration:g} s, then {'closed' if drop else 'delivered'}"

            def end() -> None:
                link.heal(drop=drop)

        fault["t_ns"] = time.time_ns()
        fault["detail"] = detail
        self._end_after(duration, end, fault)
        return fault

    def _partition_publisher(self, long: bool) -> dict[str, Any]:
        p = self.chaos.plan
        i = self.chaos.rng.randrange(p.publishers)
        link = self.links[f"pub-{i}"]
        duration = (
            p.publish_timeout_s + max(1.0, 0.5 * p.ttl_s) if long else 0.5 * p.publish_timeout_s
        )
        link.blackhole()
        fault = {
            "kind": "partition",
            "publisher": i,
            "t_ns": time.time_ns(),
            "blackhole_s": duration,
            "longer_than_publish_timeout": long,
            "detail": f"publisher {i} blackhole {duration:g} s "
            f"({'>' if long else '<'} publish_timeout_s {p.publish_timeout_s:g})",
        }
        self._end_after(duration, link.heal, fault)
        return fault

    def _end_after(self, duration: float, end: Any, fault: dict[str, Any]) -> None:
        def finish() -> None:
            end()
            fault["end_ns"] = time.time_ns()

        self.chaos._after(duration, finish)


def net_facts(led: Ledgers, faults: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Publish failures inside and outside the publisher blackholes, and what became of them."""
    timeout_ns = int(plan.publish_timeout_s * 1e9)
    windows = [
        (f["t_ns"], f.get("end_ns", f["t_ns"]) + timeout_ns, f["longer_than_publish_timeout"], f)
        for f in faults
        if f["kind"] == "partition" and "publisher" in f
    ]
    in_long = in_short = 0
    for f in faults:
        if "publisher" in f:
            f["publish_failed"] = 0
    for _r, _s, at, err in led.publish_failed:
        if replicas_short(err):  # stored, a replica not in sync yet (Redis-side faults)
            continue
        for lo, hi, long, f in windows:
            if lo <= at <= hi:
                f["publish_failed"] += 1
                in_long += long
                in_short += not long
                break
    last_ack = max((p.acked_ns for p in led.published), default=0)
    long_missed = [
        f["detail"]
        for lo, _hi, long, f in windows
        if long and not f["publish_failed"] and last_ack > f.get("end_ns", lo)
    ]
    return {
        "publish_failed_in_long_partitions": in_long,
        "publish_failed_in_short_partitions": in_short,
        "long_partitions_without_failed_publish": long_missed,
    }


def net_checks(plan: Plan, res: dict[str, Any]) -> dict[str, bool]:
    """Scenario facts of the network faults (added to the verdict when the run used them)."""
    checks = {}
    if any("publisher" in f for f in res["faults"]):
        # a partition shorter than publish_timeout_s delays publishes; it does not fail them
        checks["short_partition_no_publish_failed"] = res["publish_failed_in_short_partitions"] == 0
        checks["long_partition_publishes_failed"] = not res[
            "long_partitions_without_failed_publish"
        ]
    return checks
