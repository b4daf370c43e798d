"""What a read or a stream says on the driver about entries it cannot give: gap records
overlapping it, offsets past the last entry. Each is a `TierError` with ``onGap`` /
``failOnDataLoss`` ``fail``, else a warning on logger ``eventbus.spark`` and a `RuntimeWarning`
in the driver's process (once per read, or per micro-batch of a stream)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from eventbus.protocol.ids import EntryId, parse_id
from eventbus.tier.errors import TierError

log = logging.getLogger("eventbus.spark")


def fail_or_warn(text: str, on_gap: str | None) -> None:
    """Raise `TierError` with `text` when ``on_gap == "fail"``, else say it on the driver: a
    warning on logger ``eventbus.spark`` and a `RuntimeWarning` (pointing at the caller of
    ``surface_*``: `eventbus.spark.planning.surface` for batch reads)."""
    if on_gap == "fail":
        raise TierError(text)
    log.warning(text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)


def surface_beyond(topic: str, beyond: Sequence[str], on_gap: str | None) -> None:
    """Warn about (``on_gap="fail"``: raise `TierError` for) a read whose starting offsets are
    past the shards' last entries: entries added later before those offsets would never be
    read by a read or stream started there (a mistyped offset, or a stream Redis lost)."""
    if not beyond:
        return
    text = (
        f"topic {topic!r}: startingOffsets past the last entry ("
        + "; ".join(beyond[:5])
        + "): nothing to read there, and entries added before those offsets would be skipped"
    )
    fail_or_warn(text, on_gap)


def surface_gaps(topic: str, gaps: Sequence[dict[str, Any]], on_gap: str | None) -> None:
    """Warn about (or, with ``on_gap="fail"``, raise `TierError` for) gap records in a read,
    on the driver (a warning on logger ``eventbus.spark`` and a `RuntimeWarning`)."""
    if not gaps:
        return
    lost = sum(g.get("lost_entries") or 0 for g in gaps)
    text = (
        f"topic {topic!r}: {len(gaps)} gap record(s) overlap this read ({lost} entries known "
        "lost before they were archived; onGap / failOnDataLoss decide whether this fails); "
        "read them with option('table', 'gaps'): " + ", ".join(g["key"] for g in gaps[:5])
    )
    fail_or_warn(text, on_gap)


def surface_loss(topic: str, beyond: Sequence[str], on_gap: str) -> None:
    """The query's offsets are past the archive's and the stream's last entries (the stream was
    deleted and recreated, or the store is another): fail (failOnDataLoss) or warn."""
    text = (
        f"topic {topic!r}: the query's offsets are beyond the archive and the stream ("
        + "; ".join(beyond[:5])
        + "): entries added there would be skipped; failOnDataLoss=false reads on"
    )
    fail_or_warn(text, on_gap)


def lost_in(gap: dict[str, Any], after: EntryId, upto: EntryId) -> bool:
    """Whether gap record `gap` (entries lost strictly between its after and before) overlaps
    the range (`after`, `upto`]."""
    return parse_id(gap["before"]) > after.next() and parse_id(gap["after"]) < upto
