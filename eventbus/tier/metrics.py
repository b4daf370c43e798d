"""Prometheus metrics of the durable tier (prometheus-client), labelled by ``topic``.

Every name starts ``eventbus_tier_`` (docs/tier.md lists them). Byte counts are bytes; durations
are seconds.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_L = ("topic",)


def _counter(name: str, documentation: str) -> Counter:
    """The counter ``eventbus_tier_<name>``, labelled by ``topic``."""
    return Counter(f"eventbus_tier_{name}", documentation, _L)


class _TierMetrics:
    """The tier's metric objects, created once at import (prometheus names are global)."""

    # writing segments
    segments = _counter("segments_written_total", "Segments written to the object store")
    entries = _counter("entries_archived_total", "Entries archived in segments")
    raw_bytes = _counter("raw_bytes_total", "Entry bytes (fields + values) archived")
    stored_bytes = _counter("stored_bytes_total", "Segment bytes written to the object store")
    put_seconds = Histogram(
        "eventbus_tier_put_seconds",
        "Segment put latency (seconds)",
        _L,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )
    adopted = _counter(
        "segments_adopted_total",
        "Segments found already stored (crash or race recovery) and adopted",
    )
    # losses, and reading segments back
    gaps = _counter("gaps_total", "Gaps recorded: entries trimmed before being archived")
    lost = _counter("lost_entries_total", "Entries lost in recorded gaps (when countable)")
    caught_up = _counter("catch_up_entries_total", "Entries handled from segments by catch-up")


TIER_METRICS = _TierMetrics()
