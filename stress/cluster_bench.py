"""``bench.py --cluster``: publish-to-handler latency on one Redis and on a 3-primary Redis
Cluster, in the same run, with the CPU each side spent per event.

For each topology (a fresh private ``redis-server``, then a fresh 3-primary cluster on loopback)
it runs bench.py's latency step (publish at ``--rate`` events/s for ``--seconds`` s from this
process, one consumer process with a no-op handler) and records:

* ``<topo>_latency_ms_p50`` / ``_p99``: publisher wall clock to handler start;
* ``<topo>_redis_cpu_us_per_event``: Redis CPU (``INFO cpu`` user + sys, summed over the nodes)
  per event; ``<topo>_redis_cpu_share``: that CPU per node;
* ``<topo>_commandstats``: per command, calls per event and ``usec_per_call`` (``INFO
  commandstats``, summed over the nodes);
* ``<topo>_publisher_cpu_us_per_event`` (this process) and ``<topo>_consumer_cpu_us_per_event``
  (the consumer process, from ``getrusage(RUSAGE_CHILDREN)``).

Keys are ``single_...`` and ``cluster_...``; `cluster_latency_ms_p99` has a target of
<= 10 ms at 2,000 events/s. Compare CPU per event, not wall time: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from localredis.cluster import ReplicatedCluster
from localredis.server import RedisServer

Latency = Callable[[str, int, float, Path], Awaitable[dict[str, Any]]]


def _node_stats(ports: list[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for port in ports:
        with redis.Redis(port=port) as r:
            cpu = r.info("cpu")
            out[port] = {
                "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                "cmd": {
                    k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                    for k, v in r.info("commandstats").items()
                },
            }
    return out


def _delta(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], events: int
) -> dict[str, Any]:
    cpu = {p: after[p]["cpu"] - before[p]["cpu"] for p in after}
    total = sum(cpu.values())
    cmds: dict[str, list[int]] = {}
    for p in after:
        for name, (calls, usec) in after[p]["cmd"].items():
            c0, u0 = before[p]["cmd"].get(name, (0, 0))
            agg = cmds.setdefault(name, [0, 0])
            agg[0] += calls - c0
            agg[1] += usec - u0
    return {
        "redis_cpu_us_per_event": total * 1e6 / events,
        "redis_cpu_share": {str(p): round(c / total, 3) if total else 0.0 for p, c in cpu.items()},
        "commandstats": {
            name: {
                "calls_per_event": round(calls / events, 4),
                "usec_per_call": round(usec / calls, 3),
            }
            for name, (calls, usec) in sorted(cmds.items())
            if calls
        },
    }


async def cluster_vs_single(args: argparse.Namespace, latency: Latency) -> dict[str, Any]:
    """The ``--cluster`` run of bench.py (see the module docstring)."""
    events = int(args.rate * args.seconds)
    res: dict[str, Any] = {"rate": args.rate, "seconds": args.seconds, "events": events}
    tmp = Path(args.json).parent
    for name in ("single", "cluster"):
        topo: Any = ReplicatedCluster(3, 0) if name == "cluster" else RedisServer()
        print(f"{name}: latency at {args.rate} events/s for {args.seconds} s ...", flush=True)
        os.environ["EVENTBUS_CLUSTER"] = "true" if name == "cluster" else "false"
        try:
            with topo:
                ports = [n.port for n in topo.nodes] if name == "cluster" else [topo.port]
                before = _node_stats(ports)
                cpu0 = time.process_time()
                child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                lat = await latency(topo.url, args.rate, args.seconds, tmp / f"{name}.tmp.json")
                child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                publisher_cpu = time.process_time() - cpu0
                costs = _delta(before, _node_stats(ports), events)
        finally:
            os.environ.pop("EVENTBUS_CLUSTER", None)
            (tmp / f"{name}.tmp.json").unlink(missing_ok=True)
        consumer_cpu = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
        res[f"{name}_latency_ms_p50"] = lat["latency_ms_p50"]
        res[f"{name}_latency_ms_p99"] = lat["latency_ms_p99"]
        res[f"{name}_handled"] = lat["handled"]
        res[f"{name}_publisher_cpu_us_per_event"] = publisher_cpu * 1e6 / events
        res[f"{name}_consumer_cpu_us_per_event"] = consumer_cpu * 1e6 / events
        for key, value in costs.items():
            res[f"{name}_{key}"] = value
    res["loadavg"] = os.getloadavg()
    return res


def report(res: dict[str, Any]) -> None:
    for name in ("single", "cluster"):
        print(
            f"{name:8} p50 {res[f'{name}_latency_ms_p50']:6.2f} ms  "
            f"p99 {res[f'{name}_latency_ms_p99']:6.2f} ms  "
            f"redis {res[f'{name}_redis_cpu_us_per_event']:6.1f} us/event  "
            f"publisher {res[f'{name}_publisher_cpu_us_per_event']:6.1f} us/event  "
            f"consumer {res[f'{name}_consumer_cpu_us_per_event']:6.1f} us/event"
        )
    print(f"load average {res['loadavg']}")
