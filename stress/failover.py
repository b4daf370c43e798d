"""The ``failover`` chaos scenario: publishers and consumers on a Redis Sentinel topology (a
primary, two replicas, three sentinels, all on loopback), the primary SIGKILLed under load a few
times; each time a replica is promoted and the clients carry on with it through
`eventbus.connection.connect`'s Sentinel-managed client. The killed node comes back as a replica
of the new primary, so the next failover again has two replicas.

    python stress/failover.py [--events N] [--rate R] [--faults F] [--consumers K]
        [--publishers P] [--replicas 0,1] [--runs N] [--ttl S] [--json FILE] [--keep]

Every run is made once per ``--replicas`` value (``publish_replicas``: 1 makes every publish
wait for one replica, WAIT; 0 does not). The worker processes are chaos.py's (`consumer_role`,
`publisher_role`, imported, not copied) and the checks are ledger.py's: lost (acknowledged but
never handled), per-resource order violations, duplicates, handler starts with a superseded
fencing token. Results go to ``stress/results/failover.json``. The exit code is 1 when a run
with ``publish_replicas >= 1`` lost an acknowledged publish, or any run broke order or started
a handler with a superseded token; losses without WAIT are measured, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import redis
from chaos import GROUP, SHARDS, TOPIC, consumer_role, publisher_role
from ledger import check, read_run

from eventbus.keys import Keys
from eventbus.testing.server import RedisSentinel

HERE = Path(__file__).resolve().parent


class Failover:
    """One run: the topology, the worker processes, the kills, the drain, the checks."""

    def __init__(self, args: argparse.Namespace, replicas: int, workdir: Path) -> None:
        self.args = args
        self.replicas = replicas
        self.dir = workdir
        self.keys = Keys()
        self.top = RedisSentinel(replicas=2, sentinels=3, down_after_ms=args.down_after_ms)
        self.consumers: list[subprocess.Popen[bytes]] = []
        self.publishers: list[subprocess.Popen[bytes]] = []
        self.faults: list[dict[str, Any]] = []

    # -- processes ------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {
            "sentinels": self.top.sentinel_addresses,
            "sentinel_service": self.top.service,
            "shards": SHARDS,
            "publish_replicas": self.replicas,
            "publish_timeout_s": self.args.publish_timeout_s,
            "redis_connect_timeout_s": 1.0,
            "redis_timeout_margin_s": 2.0,
        }

    def _spawn(self, role: str, cfg: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}"}
        publisher = role == "_publisher"
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), role, json.dumps(cfg)],
                env=env,
                stdin=subprocess.PIPE if publisher else subprocess.DEVNULL,
                stdout=subprocess.PIPE if publisher else out,
                stderr=out,
            )

    def spawn_consumer(self) -> None:
        i = len(self.consumers)
        cfg = {
            "ledger": str(self.dir / f"con-{i}.log"),
            "settings": self.settings()
            | {"liveness_ttl_s": self.args.ttl, "block_max_ms": 100, "retry_base_s": 0.02,
               "retry_max_s": 0.5},
        }  # fmt: skip
        self.consumers.append(self._spawn("_consumer", cfg, self.dir / f"con-{i}.out"))

    def workload(self) -> list[dict[str, Any]]:
        a = self.args
        names = [[f"p{i}-r{j}" for j in range(a.resources)] for i in range(a.publishers)]
        per, extra = divmod(a.events, a.publishers * a.resources)
        flat = [r for rs in names for r in rs]
        count = {r: per + (k < extra) for k, r in enumerate(flat)}
        return [
            {
                "ledger": str(self.dir / f"pub-{i}.log"),
                "settings": self.settings(),
                "resources": rs,
                "counts": [count[r] for r in rs],
                "poison": [],
                "slow": [],
                "slow_ms": 0.0,
                "pad": 64,
                "rate": a.rate / a.publishers,
            }
            for i, rs in enumerate(names)
        ]

    # -- Redis ----------------------------------------------------------------------------------
    def primary(self) -> redis.Redis:
        return redis.Redis(port=self.top.primary_port, socket_timeout=5, socket_connect_timeout=2)

    def published(self) -> int:
        try:
            with self.primary() as r:
                pipe = r.pipeline(transaction=False)
                for s in range(SHARDS):
                    pipe.xlen(self.keys.stream(TOPIC, s))
                return int(sum(pipe.execute()))
        except (redis.ConnectionError, redis.TimeoutError):
            return -1

    def remaining(self) -> int:
        """Entries of the primary's shard streams the group has not acked (-1: unreachable)."""
        try:
            with self.primary() as r:
                total = 0
                for s in range(SHARDS):
                    stream = self.keys.stream(TOPIC, s)
                    if not r.exists(stream):
                        continue
                    last = r.xinfo_stream(stream)["last-generated-id"]
                    for g in r.xinfo_groups(stream):
                        if g["name"] == GROUP.encode():
                            total += int(g["pending"]) + (g["last-delivered-id"] != last)
                return total
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return -1

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        started = time.monotonic()
        self.top.start()
        try:
            for _ in range(a.consumers):
                self.spawn_consumer()
            self.publishers = [
                self._spawn("_publisher", cfg, self.dir / f"pub-{i}.out")
                for i, cfg in enumerate(self.workload())
            ]
            with self.primary() as r:
                deadline = time.monotonic() + 60
                while r.zcard(self.keys.members(TOPIC, GROUP)) < a.consumers:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"consumers did not join; see {self.dir}")
                    time.sleep(0.05)
            for pub in self.publishers:
                assert pub.stdout is not None
                if pub.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"a publisher failed to start; see {self.dir}")
            t0, t0_ns = time.monotonic(), time.time_ns()
            for pub in self.publishers:
                assert pub.stdin is not None
                pub.stdin.write(b"go\n")
                pub.stdin.close()
            at = [(i + 1) / (a.faults + 1) for i in range(a.faults)]
            while any(p.poll() is None for p in self.publishers):
                if at and self.published() >= at[0] * a.events:
                    at.pop(0)
                    self.kill_primary(t0_ns)
                time.sleep(0.05)
            published_s = time.monotonic() - t0
            drain = self.drain()
            self.stop_consumers()
            led = read_run(self.dir)
            res = check(led, [], [], t0_ns)
            res.pop("timeline", None)
            res |= {
                "t0_ns": t0_ns,
                "switches": self.switches(),
                "publish_replicas": self.replicas,
                "faults": self.faults,
                "faults_missed": len(at),
                "drain": drain,
                "published_s": published_s,
                "wall_s": time.monotonic() - started,
                "publisher_exit_codes": [p.returncode for p in self.publishers],
                "consumer_exit_codes": [c.returncode for c in self.consumers],
            }
            return res
        finally:
            for p in (*self.consumers, *self.publishers):
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.top.stop()
            for i, proc in enumerate((*self.top.nodes, *self.top.sentinels)):
                kind = "node" if i < len(self.top.nodes) else "sentinel"
                log = proc.dir / "redis.log"
                if log.exists():  # evidence: promotions, +switch-master, +sdown, syncs
                    shutil.copy(log, self.dir / f"{kind}-{proc.port}.log")
            self.top.__exit__()  # removes the temporary folders

    def kill_primary(self, t0_ns: int) -> None:
        old = self.top.primary_port
        before = self.published()
        t = time.monotonic()
        t_ns = time.time_ns()
        new = self.top.failover(kill=True)
        promoted_s = time.monotonic() - t
        self.top.restart(old)  # back as a replica of the new primary
        fault = {
            "kind": "failover",
            "t_ns": t_ns,
            "t_rel_s": round((t_ns - t0_ns) / 1e9, 3),
            "old_primary": old,
            "new_primary": new,
            "entries_before": before,
            "promoted_s": round(promoted_s, 3),
            "rejoined_s": round(time.monotonic() - t, 3),
        }
        self.faults.append(fault)
        print(f"  failover {len(self.faults)}: {old} -> {new} promoted in {promoted_s:.2f} s",
              flush=True)  # fmt: skip

    def switches(self) -> list[str]:
        """Every ``+switch-master`` a sentinel logged (planned or not), from the first sentinel."""
        log = self.top.sentinels[0].dir / "redis.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return [
            line
            for line in text.splitlines()
            if "+switch-master" in line or "+sdown master" in line
        ]

    def drain(self) -> dict[str, Any]:
        start = time.monotonic()
        last, changed = None, time.monotonic()
        while True:
            left = self.remaining()
            if left == 0:
                return {"drained": True, "drain_s": time.monotonic() - start}
            if left != last:
                last, changed = left, time.monotonic()
            elif time.monotonic() - changed > 15 + 5 * self.args.ttl:
                return {"drained": False, "drain_s": time.monotonic() - start, "remaining": left}
            time.sleep(0.1)

    def stop_consumers(self) -> None:
        for c in self.consumers:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in self.consumers:
            try:
                c.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()


KEYS = (
    "publish_replicas", "events", "publish_failed", "handled", "lost", "order_violations",
    "t0_ns", "switches", "duplicates", "duplicates_redelivered", "duplicates_republished",
    "stale_token_starts",
    "handled_but_publish_failed", "failed_publish_out_of_order", "handled_unknown",
    "torn_ledger_lines", "events_per_s", "latency_ms_p99", "latency_ms_max", "faults_missed",
    "drain", "published_s", "wall_s", "faults", "lost_examples", "violation_examples",
    "stale_token_examples", "publisher_exit_codes", "consumer_exit_codes",
)  # fmt: skip


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(int(x[key]) for x in runs)

    return {
        "runs": len(runs),
        "failovers": sum(len(x["faults"]) for x in runs),
        "acknowledged": total("events"),
        "lost_per_run": [x["lost"] for x in runs],
        "lost": total("lost"),
        "order_violations": total("order_violations"),
        "duplicates": total("duplicates"),
        "stale_token_starts": total("stale_token_starts"),
        "publish_failed": total("publish_failed"),
        "promoted_s": [f["promoted_s"] for x in runs for f in x["faults"]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--rate", type=float, default=4_000.0, help="events/s, all publishers")
    parser.add_argument("--faults", type=int, default=3, help="primary kills per run")
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--resources", type=int, default=100, help="per publisher")
    parser.add_argument("--replicas", default="1,0", help="publish_replicas values to run")
    parser.add_argument("--runs", type=int, default=1, help="runs per publish_replicas value")
    parser.add_argument("--ttl", type=float, default=3.0, help="consumer liveness TTL, s")
    parser.add_argument("--down-after-ms", dest="down_after_ms", type=int, default=1000)
    parser.add_argument("--publish-timeout-s", dest="publish_timeout_s", type=float, default=10)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "failover.json")
    parser.add_argument("--keep", action="store_true", help="keep the ledger folders")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    ok = True
    for replicas in [int(x) for x in args.replicas.split(",")]:
        for n in range(args.runs):
            wd = Path(tempfile.mkdtemp(prefix=f"failover-r{replicas}-"))
            print(f"failover run {n + 1}/{args.runs}, publish_replicas={replicas}: {wd}",
                  flush=True)  # fmt: skip
            res = {k: v for k, v in Failover(args, replicas, wd).run().items() if k in KEYS}
            good = (
                res["order_violations"] == 0
                and res["stale_token_starts"] == 0
                and res["drain"]["drained"]
                and not res["faults_missed"]
                and (replicas == 0 or res["lost"] == 0)
            )
            ok &= good
            res |= {"ok": good, "workdir": str(wd)}
            runs.append(res)
            print(f"  {'OK' if good else 'FAILED'}: events {res['events']:,} (publish failed "
                  f"{res['publish_failed']}), lost {res['lost']}, order violations "
                  f"{res['order_violations']}, duplicates {res['duplicates']}, stale-token "
                  f"starts {res['stale_token_starts']}, {len(res['faults'])} failovers",
                  flush=True)  # fmt: skip
            if good and not args.keep:
                shutil.rmtree(wd, ignore_errors=True)
    summary = {str(r): _summary([x for x in runs if x["publish_replicas"] == r])
               for r in sorted({x["publish_replicas"] for x in runs})}  # fmt: skip
    out = {"scenario": "failover", "args": vars(args) | {"json": str(args.json)},
           "ok": ok, "by_publish_replicas": summary, "runs": runs}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(summary, indent=1))
    print(f"written {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("_consumer", "_publisher"):
        role = consumer_role if sys.argv[1] == "_consumer" else publisher_role
        anyio.run(role, json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
