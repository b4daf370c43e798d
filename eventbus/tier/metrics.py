"""Prometheus metrics of the durable tier (prometheus-client), labelled by ``topic``.

Byte counts are bytes; durations are seconds.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_L = ("topic",)


class _TierMetrics:
    """The tier's metric objects, created once at import (prometheus names are global)."""

    segments: Counter = Counter(
        "eventbus_tier_segments_written_total", "Segments written to the object store", _L
    )
    entries: Counter = Counter(
        "eventbus_tier_entries_archived_total", "Entries archived in segments", _L
    )
    raw_bytes: Counter = Counter(
        "eventbus_tier_raw_bytes_total", "Entry bytes (fields + values) archived", _L
    )
    stored_bytes: Counter = Counter(
        "eventbus_tier_stored_bytes_total", "Segment bytes written to the object store", _L
    )
    adopted: Counter = Counter(
        "eventbus_tier_segments_adopted_total",
        "Segments found already stored (crash or race recovery) and adopted",
        _L,
    )
    gaps: Counter = Counter(
        "eventbus_tier_gaps_total", "Gaps recorded: entries trimmed before being archived", _L
    )
    lost: Counter = Counter(
        "eventbus_tier_lost_entries_total", "Entries lost in recorded gaps (when countable)", _L
    )
    caught_up: Counter = Counter(
        "eventbus_tier_catch_up_entries_total", "Entries handled from segments by catch-up", _L
    )
    put_seconds: Histogram = Histogram(
        "eventbus_tier_put_seconds",
        "Segment put latency (seconds)",
        _L,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )


TIER_METRICS = _TierMetrics()
