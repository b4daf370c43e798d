"""Repeated ``failover`` chaos runs, with and without ``publish_replicas``: a thin wrapper of
chaos.py's ``failover`` scenario (a Sentinel deployment, topology.py: a primary, two replicas,
three sentinels; the primary SIGKILLed under load, a replica promoted, the killed node back as a
replica; redisfaults.py).

    python stress/failover.py [--events N] [--rate R] [--faults F] [--consumers K]
        [--publishers P] [--replicas 1,0] [--runs N] [--ttl S] [--down-after-ms MS] [--json FILE]
        [--keep]

Every run is made once per ``--replicas`` value (``publish_replicas``: 1 makes every publish
wait for one replica, WAIT; 0 does not). The checks are chaos.py's (lost, order violations,
duplicates, handler starts with a superseded fencing token, unplanned failovers); a loss
without WAIT is measured, not failed. Results: ``stress/results/failover.json``, one summary
per ``publish_replicas`` value and every run's report. Exit code 1 when a run failed a check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from chaos import PRESETS, Plan, run_plan, summary

HERE = Path(__file__).resolve().parent
KEPT = (
    "ok", "checks", "events", "publish_failed", "handled", "lost",
    "lost_examples", "order_violations", "violation_examples", "duplicates",
    "duplicates_redelivered", "duplicates_republished", "stale_token_starts",
    "stale_token_examples", "handled_but_publish_failed", "failed_publish_out_of_order",
    "events_per_s", "latency_ms_p50", "latency_ms_p99", "latency_ms_max", "faults",
    "failover_promoted_s", "failover_rejoined_s", "lost_acked_within_1s_before_a_failover",
    "promotions_logged", "drain", "published_s", "wall_s", "topology", "workdir",
)  # fmt: skip


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(int(x[key]) for x in runs)

    return {
        "runs": len(runs),
        "failovers": sum(len(x["faults"]) for x in runs),
        "unplanned_failovers": sum(len(x["promotions_logged"]) - len(x["faults"]) for x in runs),
        "acknowledged": total("events"),
        "lost_per_run": [x["lost"] for x in runs],
        "lost": total("lost"),
        "order_violations": total("order_violations"),
        "duplicates": total("duplicates"),
        "stale_token_starts": total("stale_token_starts"),
        "publish_failed": total("publish_failed"),
        "promoted_s": [s for x in runs for s in x["failover_promoted_s"]],
    }


def main(argv: list[str] | None = None) -> int:
    preset = PRESETS["failover"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=preset["events"])
    parser.add_argument("--rate", type=float, default=preset["rate"], help="events/s in all")
    parser.add_argument("--faults", type=int, default=preset["faults"], help="kills per run")
    parser.add_argument("--consumers", type=int, default=preset["consumers"])
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--resources", type=int, default=100, help="per publisher")
    parser.add_argument("--replicas", default="1,0", help="publish_replicas values to run")
    parser.add_argument("--runs", type=int, default=1, help="runs per publish_replicas value")
    parser.add_argument("--ttl", type=float, default=preset["ttl_s"], help="liveness TTL, s")
    parser.add_argument("--down-after-ms", dest="down_after_ms", type=int, default=3000)
    parser.add_argument("--publish-timeout-s", dest="publish_timeout_s", type=float, default=10)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "failover.json")
    parser.add_argument("--keep", action="store_true", help="keep the ledger folders")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for replicas in [int(x) for x in args.replicas.split(",")]:
        for n in range(args.runs):
            plan = Plan(
                "failover", events=args.events, rate=args.rate, consumers=args.consumers,
                publishers=args.publishers, resources=args.resources, faults=args.faults,
                kinds=["failover"], ttl_s=args.ttl, publish_timeout_s=args.publish_timeout_s,
                publish_replicas=replicas, down_after_ms=args.down_after_ms, seed=n + 1,
            )  # fmt: skip
            print(f"failover run {n + 1}/{args.runs}, publish_replicas={replicas}", flush=True)
            res = run_plan(plan, keep=args.keep)
            print(summary(res), flush=True)
            runs.append({k: res.get(k) for k in KEPT} | {"publish_replicas": replicas})
    by = {str(r): _summary([x for x in runs if x["publish_replicas"] == r])
          for r in sorted({x["publish_replicas"] for x in runs})}  # fmt: skip
    ok = all(x["ok"] for x in runs)
    out = {"scenario": "failover", "args": vars(args) | {"json": str(args.json)}, "ok": ok,
           "by_publish_replicas": by, "runs": runs}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(by, indent=1))
    print(f"written {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
