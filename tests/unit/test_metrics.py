"""The Grafana dashboard (docs/grafana-dashboard.json) names only metrics eventbus exports, and
the shard lock metrics count takeovers apart."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from eventbus.locking.locks import Grant, LockRound, LockState
from eventbus.ops.metrics import METRICS, ShardMetrics

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"


def test_dashboard_queries_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\beventbus_\w+", e)}
    exported = {s.name for family in REGISTRY.collect() for s in family.samples}
    exported |= {f.name for f in REGISTRY.collect()}
    names = {n for n in exported if n.startswith("eventbus_")}
    # histograms and counters without a labelled child yet expose no sample: add their suffixes
    families = {f.name for f in REGISTRY.collect() if f.name.startswith("eventbus_")}
    for f in families:
        names |= {f + s for s in ("_total", "_bucket", "_sum", "_count")}
    assert used and used <= names, used - names


def _sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return value or 0.0


def test_shard_metrics_count_takeovers_apart() -> None:
    m = ShardMetrics("unit-topic", "unit-group")
    labels = {"topic": "unit-topic", "group": "unit-group"}
    grants = {
        0: Grant(0, 5, LockState.TAKEN_FREE),
        1: Grant(1, 9, LockState.TAKEN_FROM_DEAD),
        2: Grant(2, 3, LockState.HELD),
    }
    taken = LockRound(share=3, grants=grants, sent_at=0.0).taken([0, 1])
    assert taken == (1, 1)
    m.round(*taken, lost=1, held=3)
    assert _sample("eventbus_shard_locks_taken_total", {**labels, "how": "free"}) == 1
    assert _sample("eventbus_shard_locks_taken_total", {**labels, "how": "takeover"}) == 1
    assert _sample("eventbus_shard_locks_lost_total", labels) == 1
    assert _sample("eventbus_shards_held", labels) == 3
    m.round(0, 0, lost=0, held=2)
    assert _sample("eventbus_shards_held", labels) == 2
    assert METRICS.shards_held is not None


def test_observe_many_equals_one_observe_per_value() -> None:
    """A batch of values added with `observe_many` leaves the histogram exactly as one
    `observe` per value does: each bucket's count, the count and the sum (bounds inclusive)."""
    from prometheus_client import CollectorRegistry, Histogram

    from eventbus.ops.metrics import observe_many

    values = [0.0, 0.001, 0.0011, 0.5, 0.5, 3.0, 100.0, 1e9]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("x_seconds", "x", ["a"], registry=one, buckets=(0.001, 0.5, 10))
    h2 = Histogram("x_seconds", "x", ["a"], registry=many, buckets=(0.001, 0.5, 10))
    for v in values:
        h1.labels("a").observe(v)
    observe_many(h2.labels("a"), values)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for m in registry.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        }

    assert samples(many) == samples(one)
    assert samples(many)[("x_seconds_bucket", "0.001")] == 2  # 0.0 and 0.001 (le is inclusive)
