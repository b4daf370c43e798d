"""PNG of a chaos run: throughput and latency over time, faults marked (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Figure, not pyplot: renders with Agg, needs no GUI backend, and imports seconds faster
from matplotlib.figure import Figure

COLORS = {
    "kill": "tab:red",
    "pause": "tab:purple",
    "term": "tab:pink",
    "redis-restart": "tab:brown",
    "client-kill": "tab:orange",
    "client-pause": "tab:olive",
    "net-delay": "tab:gray",
    "partition": "tab:cyan",
    "failover": "black",
    "cluster-failover": "black",
}


def plot(result: dict[str, Any], path: Path) -> None:
    """Write the run's timeline to `path`: events/s (handled, published) above, publish-to-handler
    latency p50/p99 (ms, log scale) below; a vertical line per fault, a band for its duration."""
    tl = result["timeline"]
    fig = Figure(figsize=(11, 6), dpi=90)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(tl["t_s"], tl["published_per_s"], color="0.6", lw=1, label="published (acked)")
    top.plot(tl["t_s"], tl["handled_per_s"], color="tab:blue", lw=1.2, label="handled")
    top.set_ylabel("events/s")
    for key, style in (("latency_ms_p50", "-"), ("latency_ms_p99", "--")):
        pts = [(t, v) for t, v in zip(tl["t_s"], tl[key], strict=True) if v is not None]
        if pts:
            bottom.plot(
                *zip(*pts, strict=True),
                style,
                color="tab:green",
                lw=1,
                label=key.removeprefix("latency_ms_"),
            )
    bottom.set_yscale("log")
    bottom.set_ylabel("publish→handler ms")
    bottom.set_xlabel("seconds since the first publish")
    t0 = result["t0_ns"]
    seen: set[str] = set()
    for f in result["faults"]:
        color = COLORS.get(f["kind"], "black")
        x = (f["t_ns"] - t0) / 1e9
        label = f["kind"] if f["kind"] not in seen else None
        seen.add(f["kind"])
        for ax in (top, bottom):
            ax.axvline(x, color=color, lw=1, alpha=0.8, label=label if ax is top else None)
            if f.get("end_ns"):
                ax.axvspan(x, (f["end_ns"] - t0) / 1e9, color=color, alpha=0.12)
    top.legend(loc="upper right", fontsize=7, ncols=4)
    bottom.legend(loc="upper right", fontsize=7)
    where = result.get("topology", {}).get("kind", "single")
    top.set_title(
        f"{result['scenario']} ({where}): {result['events']:,} events, "
        f"{len(result['faults'])} faults, "
        f"lost {result['lost']}, order violations {result['order_violations']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
