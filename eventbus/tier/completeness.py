"""The completeness check of a replay: did the segments hold every entry the offloader
checkpoints account for? A missing segment in the middle of a shard can only be seen this way
(`check_complete`, `ArchiveGap`).
"""

from __future__ import annotations

from collections.abc import Mapping

from eventbus.tier.errors import TierError
from eventbus.tier.gaps import gap_records
from eventbus.tier.store import Store


class ArchiveGap(TierError):
    """A shard's segments hold fewer entries than its offloader checkpoint accounts for: a
    segment was deleted (or never readable) in the shard's range, so a replay has a hole.
    Carries `topic`, `shard` and the counts."""

    def __init__(self, topic: str, shard: int, accounted: int, archived: int, lost: int) -> None:
        missing = accounted - archived - lost
        super().__init__(
            f"topic {topic!r} shard {shard}: the offloader checkpoint accounts for {accounted} "
            f"entries but the segments hold {archived} (and gap records {lost}): {missing} "
            "entries are missing from the archive (a deleted segment?); restore it, or replay "
            "with --allow-gaps to accept the hole"
        )
        self.topic, self.shard = topic, shard
        self.accounted, self.archived, self.lost = accounted, archived, lost


def recorded_lost(store: Store, topic: str, shard: int) -> int | None:
    """Entries recorded as lost in `shard`'s gap records (None if a record has no count).
    Raises `CorruptGapRecord` naming a damaged record."""
    counts = [g["lost_entries"] for g in gap_records(store, topic, shard)]
    return None if None in counts else sum(counts)


def check_complete(
    store: Store, topic: str, archived: Mapping[int, int], accounted: Mapping[int, int]
) -> list[ArchiveGap]:
    """Compare, per shard, the entries read from its segments (`archived`, from a replay that
    read every segment: `iter_topic(counts=...)` with no ID or time range) plus those recorded
    lost in gap records with what its checkpoint accounts for (`accounted`, the checkpoint
    hash's ``<shard>:count``). Returns one `ArchiveGap` per shard that falls short.

    The segment keys name ranges, not counts, so a missing segment in the middle of a shard
    can only be seen against the checkpoint. Entries the offloader archived after the replay
    listed the store only make the archive look longer, never shorter."""
    gaps = []
    for shard, count in sorted(accounted.items()):
        held = archived.get(shard, 0)
        if held >= count:
            continue
        lost = recorded_lost(store, topic, shard)
        if lost is None or held + lost >= count:
            continue
        gaps.append(ArchiveGap(topic, shard, count, held, lost))
    return gaps
