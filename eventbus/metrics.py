"""Prometheus metrics (prometheus-client). `eventbus run --metrics-port` serves them.

All carry the labels ``topic`` and ``group``; latency is in seconds, from the publisher's wall
clock (the envelope's event time) to the handler's success.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_L = ("topic", "group")


class _Metrics:
    handled = Counter("eventbus_handled_total", "Entries handled successfully", _L)
    failures = Counter("eventbus_handler_failures_total", "Failed handler attempts", _L)
    handler_timeouts = Counter(
        "eventbus_handler_timeouts_total",
        "Handler attempts past handler_timeout_s: cancelled (async) or abandoned (sync)",
        _L,
    )
    dead_lettered = Counter(
        "eventbus_dead_lettered_total", "Entries written to the dead-letter stream", _L
    )
    lost = Counter("eventbus_lost_total", "Pending entries trimmed before they were processed", _L)
    redis_refusals = Counter(
        "eventbus_redis_refusals_total",
        "Redis error replies to a consumer's commands (NOPERM, OOM, ...): alert on any",
        (*_L, "command"),
    )
    trimmed_unread = Counter(
        "eventbus_trimmed_unread_total", "Entries trimmed (MAXLEN) before the group read them", _L
    )
    lease_lost = Counter(
        "eventbus_lease_lost_total", "Times a consumer dropped its shards (lease lapsed)", _L
    )
    latency = Histogram(
        "eventbus_latency_seconds",
        "Publish-to-handled latency (seconds)",
        _L,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )


METRICS = _Metrics()
