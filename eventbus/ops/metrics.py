"""Prometheus metrics (prometheus-client). `eventbus run --metrics-port` serves them.

Consumer metrics carry the labels ``topic`` and ``group``; latency is in seconds, from the
publisher's wall clock (the envelope's event time) to the handler's success. Publisher metrics
carry no label: they are counted once per pipeline, not once per event (a labelled increment per
event would cost more than the rest of a publish's bookkeeping). ``eventbus run --processes N``
runs prometheus-client's multiprocess mode, hence a ``multiprocess_mode`` on every gauge
(docs/operations.md, Metrics).
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Sized
from functools import partial
from typing import Any, cast

from prometheus_client import Counter, Gauge, Histogram

_L = ("topic", "group")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _counter(name: str, documentation: str, *labels: str) -> Counter:
    """The counter ``eventbus_<name>``, labelled by ``topic``, ``group`` and `labels`."""
    return Counter(f"eventbus_{name}", documentation, (*_L, *labels))


class _Metrics:
    """The metric objects, created once at import (prometheus names are process-wide)."""

    # -- handling -------------------------------------------------------------------------------
    handled = _counter("handled_total", "Entries handled successfully")
    failures = _counter("handler_failures_total", "Failed handler attempts")
    handler_timeouts = _counter(
        "handler_timeouts_total",
        "Handler attempts past handler_timeout_s: cancelled (async) or abandoned (sync)",
    )
    skipped_unknown = _counter(
        "skipped_unknown_total",
        "Entries of an event type no handler of the group takes, skipped (on_unknown='skip')",
    )
    dead_lettered = _counter("dead_lettered_total", "Entries written to the dead-letter stream")
    lost = _counter("lost_total", "Pending entries trimmed before they were processed")
    redis_refusals = _counter(
        "redis_refusals_total",
        "Redis error replies to a consumer's commands (NOPERM, OOM, ...): alert on any",
        "command",
    )
    trimmed_unread = _counter(
        "trimmed_unread_total", "Entries trimmed (MAXLEN) before the group read them"
    )
    lease_lost = _counter("lease_lost_total", "Times a consumer dropped its shards (lease lapsed)")
    latency = Histogram(
        "eventbus_latency_seconds", "Publish-to-handled latency (seconds)", _L, buckets=_SECONDS
    )
    handler_duration = Histogram(
        "eventbus_handler_duration_seconds",
        "Duration of successful and failed handler attempts (seconds)",
        (*_L, "handler"),
        buckets=_SECONDS,
    )
    # -- shards and lag -------------------------------------------------------------------------
    shards_held = Gauge(
        "eventbus_shards_held",
        "Shard locks held by the consumers of this process",
        _L,
        multiprocess_mode="livesum",
    )
    locks_taken = _counter(
        "shard_locks_taken_total",
        "Shard locks taken: how=free (nobody held it) or takeover (its owner's liveness expired)",
        "how",
    )
    locks_lost = _counter("shard_locks_lost_total", "Shard locks found taken by another consumer")
    lag = Gauge(
        "eventbus_consumer_lag",
        "Entries of a shard not yet delivered to the group (XINFO GROUPS lag), as last seen by "
        "the shard's holder at its trim check (every trim_check_s)",
        (*_L, "shard"),
        multiprocess_mode="livemostrecent",
    )
    # -- publishing (per pipeline) --------------------------------------------------------------
    published = Counter("eventbus_published_total", "Events whose XADD Redis confirmed")
    publish_errors = Counter(
        "eventbus_publish_errors_total", "Events whose publish failed (PublishError)"
    )
    publish_seconds = Histogram(
        "eventbus_publish_pipeline_seconds",
        "Time from a pipeline's first send to its replies (seconds; retries included)",
        buckets=_SECONDS,
    )
    publish_batch = Histogram(
        "eventbus_publish_batch_size",
        "Events per pipeline",
        buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
    )
    # -- process health (eventbus.ops.health) ---------------------------------------------------
    ready = Gauge(
        "eventbus_ready",
        "1 when every consumer of the process holds a valid lease (connected, holding or able "
        "to take shards)",
        multiprocess_mode="liveall",
    )
    loop_tick = Gauge(
        "eventbus_loop_tick_timestamp_seconds",
        "Unix time of the event loop's last health tick (a stale value: the loop is blocked)",
        multiprocess_mode="liveall",
    )


METRICS = _Metrics()


class ShardMetrics:
    """The shard lock metrics of one consumer, updated once per lock round."""

    __slots__ = ("_free", "_held", "_lost", "_takeover")

    def __init__(self, topic: str, group: str) -> None:
        self._held = METRICS.shards_held.labels(topic, group)
        self._free = METRICS.locks_taken.labels(topic, group, "free")
        self._takeover = METRICS.locks_taken.labels(topic, group, "takeover")
        self._lost = METRICS.locks_lost.labels(topic, group)

    def round(self, taken_free: int, taken_over: int, lost: int, held: int) -> None:
        """After a lock round: locks newly taken (free, or over from an expired member: as
        `LockRound.taken` counts them), `lost` lost, `held` held in all."""
        if taken_free:
            self._free.inc(taken_free)
        if taken_over:
            self._takeover.inc(taken_over)
        if lost:
            self._lost.inc(lost)
        self._held.set(held)


def observe_publish(batch: Sized, failed: int, timeout_s: float) -> None:
    """One pipeline (`eventbus.publishing.sending`) answered, `failed` of its events refused. Its
    first slot's deadline is `timeout_s` after the pipeline's first send."""
    size = len(batch)
    METRICS.publish_batch.observe(size)
    first = cast("Any", batch)[0]
    METRICS.publish_seconds.observe(time.monotonic() - (first.deadline - timeout_s))
    if size > failed:
        METRICS.published.inc(size - failed)


class Observations:
    """Values of one labelled histogram, kept in a list and added in one go by `flush` (the
    consumer flushes once per read round): `Histogram.observe` takes a lock twice per value,
    about 1 us, as much as the rest of an event's bookkeeping."""

    __slots__ = ("child", "values")

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.values: list[float] = []

    def flush(self) -> None:
        values, self.values = self.values, []
        if values:
            observe_many(self.child, values)


def observe_many(child: Histogram, values: list[float]) -> None:
    """Observe each of `values` on `child` (a labelled `Histogram`), adding each bucket's count
    and the sum once. Uses the histogram's own value objects (``_upper_bounds``, ``_buckets``,
    ``_sum``: prometheus-client's `Histogram.observe` does the same per value), so that its
    multiprocess mode sees them; falls back to `observe` per value without them."""
    h: Any = child
    bounds = getattr(h, "_upper_bounds", None)
    if bounds is None or not hasattr(h, "_buckets"):
        for v in values:
            child.observe(v)
        return
    # the first bucket with v <= its bound, counted in C (a Python loop cost 0.2 us per value)
    counts = collections.Counter(map(partial(bisect.bisect_left, bounds), values))
    h._sum.inc(sum(values))
    for i, n in counts.items():
        h._buckets[i].inc(n)
