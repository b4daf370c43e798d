"""Archive checks for demos and operators: does the store hold every event exactly once?

`verify_archive` reads every segment of a topic (verifying each, like replay does) and reports
segments, bytes, compression ratio, and entries missing, duplicated or unexpected compared with
what the caller published.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from eventbus.protocol.codec import encoded_size
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.tier.gaps import gap_records
from eventbus.tier.replay import plan, read_segment
from eventbus.tier.store import Store


@dataclass
class ArchiveReport:
    """What a topic's archive holds. Bytes are bytes.

    `raw_bytes` counts entry field names and values (what Redis stored), `stored_bytes` the
    segment objects. `duplicates` lists ``<shard>/<entry ID>`` found more than once (overlapping
    segments), `missing` / `unexpected` compare with the expected IDs when given (at most 20 of
    each are kept; the counts are exact). `duplicate_event_ids` counts event IDs seen on more
    than one entry (a publisher retry stored the same event twice).
    """

    topic: str
    segments: int = 0
    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    gap_records: int = 0
    duplicate_entries: int = 0
    duplicate_event_ids: int = 0
    missing_count: int = 0
    unexpected_count: int = 0
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    per_shard: dict[int, int] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        """Raw entry bytes per stored byte (0.0 for an empty archive)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0

    @property
    def exactly_once(self) -> bool:
        """True when no entry is duplicated, missing or unexpected (and no gap was recorded)."""
        return not (
            self.duplicate_entries
            or self.missing_count
            or self.unexpected_count
            or self.gap_records
        )


def verify_archive(
    store: Store,
    topic: str,
    *,
    expected_entry_ids: Iterable[str | EntryId] | None = None,
    shards: Iterable[int] | None = None,
) -> ArchiveReport:
    """Read every segment of `topic` in `store` and report what it holds (see `ArchiveReport`).

    `expected_entry_ids` are the entry IDs the publisher got back (``bus.publish`` returns
    them); leave it None to check only for duplicates and gaps. Blocking: from async code run
    it with ``anyio.to_thread.run_sync``. Raises `CorruptSegment` on a damaged segment,
    `StoreError` when the store fails.
    """
    report = ArchiveReport(topic)
    segments = plan(store, topic, None, list(shards) if shards is not None else None)
    seen: Counter[tuple[int, EntryId]] = Counter()  # entry IDs are unique per shard stream only
    events: Counter[uuid.UUID] = Counter()
    for shard, refs in sorted(segments.items()):
        report.segments += len(refs)
        report.stored_bytes += sum(ref.size for ref in refs)
        count = 0
        for ref in refs:
            entries = read_segment(store, ref).entries
            for entry in entries:
                seen[(shard, entry.entry_id)] += 1
                if entry.event_id is not None:
                    events[entry.event_id] += 1
                fields = entry.fields()
                report.raw_bytes += encoded_size(fields)
            count += len(entries)
        report.per_shard[shard] = count
        report.entries += count
        report.gap_records += len(gap_records(store, topic, shard))
    dups = sorted(k for k, n in seen.items() if n > 1)
    report.duplicate_entries = sum(seen[k] - 1 for k in dups)
    report.duplicates = [f"{shard}/{i}" for shard, i in dups[:20]]
    report.duplicate_event_ids = sum(n - 1 for n in events.values() if n > 1)
    if expected_entry_ids is not None:
        # publishers get entry IDs without their shard, and two shards may share an ID: compare
        # as multisets
        expected = Counter(parse_id(i) for i in expected_entry_ids)
        found = Counter(i for _, i in seen)
        missing = sorted((expected - found).elements())
        unexpected = sorted((found - expected).elements())
        report.missing_count, report.unexpected_count = len(missing), len(unexpected)
        report.missing = [str(i) for i in missing[:20]]
        report.unexpected = [str(i) for i in unexpected[:20]]
    return report


__all__ = ["ArchiveReport", "verify_archive"]
