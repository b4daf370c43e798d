"""Markdown table of chaos results: ``python stress/report.py stress/results/*.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = (
    "scenario",
    "deployment",
    "events",
    "events/s",
    "p50 ms",
    "p99 ms",
    "lost",
    "order viol.",
    "duplicates",
    "dead-lettered",
    "takeover median / max s",
    "faults",
    "checks",
)


def _num(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def row(res: dict[str, Any]) -> list[str]:
    faults = ", ".join(f"{k} {n}" for k, n in res["faults_by_kind"].items() if n) or "-"
    failed = [k for k, ok in res["checks"].items() if not ok]
    takeover = (
        f"{_num(res['takeover_s_median'], '{:.2f}')} / {_num(res['takeover_s_max'], '{:.2f}')}"
        if res["takeover_s_median"] is not None
        else "-"
    )
    return [
        res["scenario"],
        res.get("topology", {}).get("kind", "single"),
        f"{res['events']:,}",
        _num(res["events_per_s"]),
        _num(res["latency_ms_p50"], "{:.1f}"),
        _num(res["latency_ms_p99"], "{:.1f}"),
        str(res["lost"]),
        str(res["order_violations"]),
        f"{res['duplicates']:,}",
        str(res["dead_lettered"]),
        takeover,
        f"{len(res['faults'])} ({faults})",
        "ok" if not failed else "FAILED: " + ", ".join(failed),
    ]


def main(paths: list[str]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for path in paths:
        print("| " + " | ".join(row(json.loads(Path(path).read_text()))) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
