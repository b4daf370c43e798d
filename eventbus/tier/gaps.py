"""Gap detection and gap records: entries that left Redis before they were archived.

``XADD ... MAXLEN ~`` keeps Redis's memory bounded; if the offloader is down for too long it
trims entries the offloader never saw. Redis 7.0 does not raise ``max-deleted-entry-id`` when it
trims (only XDEL does), so detection compares counts:

* ``entries-added`` (XINFO STREAM) counts every entry ever added to the stream;
* the checkpoint hash counts entries *accounted for*, archived or recorded lost
  (``<shard>:count``);
* the offloader knows how many entries it has read but not yet archived (its buffer).

When the stream's first entry lies after everything the offloader has read (so no entry it
has not seen is left before that first entry), ``entries-added - length - accounted - buffered``
is exactly the number of entries that vanished unread. A positive number is a gap: the entries
strictly between the last one read (``after``) and the stream's first entry (``before``; the
next ID after ``last-generated-id`` when the stream is empty). An XDEL past the read position
(``max-deleted-entry-id``) is reported the same way, with an unknown count.

The offloader first accounts a gap in Redis (`Checkpoints.account_gap`, fenced, from the
current checkpoint and count), then `record_gap` stores it as a JSON object at `layout.gap_key`
(create-only, so a second try after a crash stores it once), counts it in
``eventbus_tier_gaps_total`` and ``eventbus_tier_lost_entries_total``, and logs it at ERROR
level: loss is never silent (docs/tier.md "Gaps").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.tier.errors import CorruptGapRecord
from eventbus.tier.layout import gap_key, gap_prefixes, parse_gap_key
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.store import Store, get_bytes_sync, list_keys_sync, put_create

log = logging.getLogger("eventbus.tier")


@dataclass(frozen=True, slots=True)
class Gap:
    """Entries of `topic`/`shard` with `after` < ID < `before` were lost; `lost_entries` of
    them (None when unknown). `detected_at_ms` is Unix ms."""

    topic: str
    shard: int
    after: str
    before: str
    lost_entries: int | None
    detected_at_ms: int
    detected_by: str
    reason: str

    @property
    def key(self) -> str:
        return gap_key(self.topic, self.shard, parse_id(self.after), parse_id(self.before))


def find_gap(
    info: dict[str, Any], read_to: EntryId | None, accounted: int, buffered: int
) -> tuple[EntryId, EntryId, int | None, str] | None:
    """Decide from an ``XINFO STREAM`` reply whether entries were lost after `read_to` (the
    last entry the offloader has read; None: none yet), given the entries `accounted` for in the
    checkpoint hash and `buffered` (read, not yet archived).

    Returns (after, before, lost entries or None, reason), or None when nothing was lost.
    """
    position = read_to or ZERO
    added = int(info.get("entries-added") or 0)
    length = int(info.get("length") or 0)
    first = info.get("first-entry")
    if first is not None:
        head = parse_id(first[0])
    else:
        head = parse_id(info.get("last-generated-id") or b"0-0").next()
    if head > position:
        lost = added - length - accounted - buffered
        if lost > 0:
            return position, head, lost, "trimmed before archiving (XADD MAXLEN or XTRIM)"
    max_deleted = parse_id(info.get("max-deleted-entry-id") or b"0-0")
    if max_deleted > position:
        return position, max_deleted.next(), None, "deleted before archiving (XDEL)"
    return None


_GAP_RECORD = TypeAdapter(Gap)


def parse_gap(data: bytes, key: str) -> dict[str, Any]:
    """A stored gap record (`record_gap`'s JSON) as a dict of `Gap`'s fields plus ``key``.
    Raises `CorruptGapRecord` naming `key` when it is not such a record."""
    return {**asdict(load_gap(data, key)), "key": key}


def load_gap(data: str | bytes, where: str) -> Gap:
    """The `Gap` of a gap record's JSON (`gap_json`). Raises `CorruptGapRecord` naming `where`
    (the object key, or where else the JSON was kept) when it is not such a record."""
    try:
        gap = _GAP_RECORD.validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise CorruptGapRecord(where, problems) from None
    try:
        parse_id(gap.after), parse_id(gap.before)
    except ConfigError as exc:
        raise CorruptGapRecord(where, str(exc)) from None
    return gap


def gap_json(gap: Gap) -> str:
    """`gap` as the JSON text of its record (what `record_gap` stores)."""
    return json.dumps(asdict(gap), indent=1)


def gap_records(
    store: Store, topic: str, shard: int, get: Callable[[str], bytes] | None = None
) -> list[dict[str, Any]]:
    """The gap records of `topic`/`shard` (`parse_gap` dicts), in key order; `get` reads an
    object (default: `get_bytes_sync` on `store`). Raises `CorruptGapRecord`, `StoreError`."""
    read = get or (lambda key: get_bytes_sync(store, key))
    # both layouts' folders (`eventbus.tier.layout`), one record per range: the new folder's
    by_range: dict[str, str] = {}
    for prefix in gap_prefixes(topic, shard):
        for key, _ in list_keys_sync(store, prefix):
            if parse_gap_key(key):
                by_range.setdefault(key.rsplit("/", 1)[-1], key)
    return [parse_gap(read(by_range[name]), by_range[name]) for name in sorted(by_range)]


async def record_gap(store: Store, gap: Gap) -> bool:
    """Store `gap` (create-only), log it, count it. Returns False if it was already recorded."""
    created = await put_create(store, gap.key, gap_json(gap).encode())
    if created:
        TIER_METRICS.gaps.labels(gap.topic).inc()
        if gap.lost_entries:
            TIER_METRICS.lost.labels(gap.topic).inc(gap.lost_entries)
    log.error(
        "LOST %s entries of topic %s shard %d between %s and %s (%s); recorded at %s",
        "an unknown number of" if gap.lost_entries is None else gap.lost_entries,
        gap.topic,
        gap.shard,
        gap.after,
        gap.before,
        gap.reason,
        gap.key,
    )
    return created


def new_gap(
    topic: str,
    shard: int,
    after: EntryId,
    before: EntryId,
    lost: int | None,
    reason: str,
    detected_by: str,
) -> Gap:
    """A `Gap` detected now."""
    return Gap(
        topic,
        shard,
        str(after),
        str(before),
        lost,
        time.time_ns() // 1_000_000,
        detected_by,
        reason,
    )
