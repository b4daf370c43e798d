"""The durable-tier step of the flights demo: offload, verify, replay.

After both groups handled every flight, the offloader archives the whole topic to Parquet
segments (no hot window: everything is archived and trimmed from Redis). Then:

* `verify_archive` reads every segment: counts, bytes, duplicates across segments;
* a typed replay of the segments (`eventbus.tier.replay.iter_events`, the same decoding as a
  live consumer) checks that every published flight is there exactly once (by its publish
  position) and recomputes the per-carrier aggregates, which must equal the CSV's.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from eventbus.app import EventBus
from examples.flights.flightdata import CarrierStats, Flight, aggregates_match


async def archive_and_replay(
    bus: EventBus, topic: str, published: int, reference: dict[str, CarrierStats], store_url: str
) -> dict[str, Any]:
    """Offload `topic` to the store at `store_url`, verify and replay it; returns the summary's
    ``tier`` section (bytes are bytes, rates per second). Raises `StoreError`,
    `CorruptSegment` (the tier's errors) when the store fails or holds a damaged segment."""
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store, verify_archive

    store = open_store(store_url)
    # typed segments: the Spark step reads the payload columns with Spark's own Parquet reader
    typed = {topic: f"{Flight.__module__}:{Flight.__qualname__}"}
    tier = TierSettings(hot_window_s=0, segment_max_age_s=0, trim_exact=True, typed_models=typed)
    # pyarrow imports pandas on its first use (~1-2 s, holding the GIL): not the offload's rate
    await anyio.to_thread.run_sync(_warm_up)
    started = time.perf_counter()
    stats = await offload_until_caught_up(
        bus.redis, store, topics=[topic], settings=bus.settings, tier=tier, timeout_s=900
    )
    offload_s = max(1e-9, time.perf_counter() - started)
    report = await anyio.to_thread.run_sync(lambda: verify_archive(store, topic))

    started = time.perf_counter()
    seen, replayed = await anyio.to_thread.run_sync(_replay, store, topic, published)
    replay_s = max(1e-9, time.perf_counter() - started)
    exactly_once = (
        seen.count(1) == published and not report.duplicate_entries and report.entries == published
    )
    return {
        "store": store_url,
        "segments": report.segments,
        "entries": report.entries,
        "raw_bytes": report.raw_bytes,
        "segment_bytes": report.stored_bytes,
        "compression_ratio": round(report.raw_bytes / max(1, report.stored_bytes), 3),
        "gap_records": report.gap_records,
        "offload_entries_per_s": round(stats.entries / offload_s, 1),
        "offload_mb_per_s": round(stats.raw_bytes / offload_s / 1e6, 2),
        "replay_events_per_s": round(published / replay_s, 1),
        "exactly_once": exactly_once,
        "replay_aggregates_match": aggregates_match(replayed, reference),
    }


def _warm_up() -> None:
    """Make pyarrow do its one-time first-use imports (pandas) outside the timed steps."""
    import pyarrow as pa

    pa.array([b"x"], pa.binary())


def _replay(store: Any, topic: str, published: int) -> tuple[bytearray, dict[str, CarrierStats]]:
    """How many times each publish position is in the archive (saturating at 255), and the
    per-carrier aggregates of the archived flights."""
    from eventbus.tier.replay import iter_events

    seen = bytearray(published)
    aggregates: dict[str, CarrierStats] = {}
    for replayed in iter_events(store, topic, [Flight], merge=False):
        flight: Flight = replayed.event  # type: ignore[assignment]
        if 0 <= flight.position < published and seen[flight.position] < 255:
            seen[flight.position] += 1
        aggregates.setdefault(flight.carrier, CarrierStats()).add(flight.dep_delay)
    return seen, aggregates
