"""Pruning: the conditions every wanted row of a read meets, from Spark's pushed filters.

Spark's pushed filters on ``shard``, ``resource_id`` (through the shard hash), ``entry_id``
(equality), ``entry_ms`` (ranges) and ``published_at`` (ranges, checked against each segment's
Parquet statistics) narrow the shards and entry-ID range (`Pruning.from_filters`); batch offsets
and ``startingTimestamp`` narrow them further (`Pruning.bounded`, `Pruning.added_since`).
Segments outside are never fetched. Every filter is still handed back to Spark, which applies it
to the rows: pruning only skips what cannot match. The plan itself is `eventbus.spark.planning`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    LessThan,
    LessThanOrEqual,
)

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.tier.layout import SegmentRef

MAX_ID = EntryId((1 << 64) - 1, (1 << 64) - 1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Pruning:
    """Conditions every wanted row meets. `shards` None: any. Entry IDs in [`lo`, `hi`];
    publisher time (Unix ms) in [`time_lo`, `time_hi`] when set."""

    shards: frozenset[int] | None = None
    resource_ids: frozenset[str] | None = None
    lo: EntryId = ZERO
    hi: EntryId = MAX_ID
    time_lo: int | None = None
    time_hi: int | None = None

    @classmethod
    def from_filters(cls, filters: Sequence[Filter]) -> Pruning:
        """The conditions of the pushed `filters` that prune (others are ignored here)."""
        p = cls()
        for f in filters:
            p = p._with(f)
        return p

    def _with(self, f: Filter) -> Pruning:
        col = getattr(f, "attribute", ("",))
        name = col[0] if len(col) == 1 else ""
        value = getattr(f, "value", None)
        values: tuple[Any, ...] = tuple(f.value) if isinstance(f, In) else (value,)
        exact = isinstance(f, EqualTo | In)
        if name == "shard" and exact:
            return _replace(self, shards=_meet(self.shards, {int(v) for v in values}))
        if name == "resource_id" and exact:
            return _replace(self, resource_ids=_meet(self.resource_ids, set(map(str, values))))
        if name == "entry_id" and exact:
            try:
                ids = sorted(parse_id(str(v)) for v in values)
            except ConfigError:
                return self
            return _replace(self, lo=max(self.lo, ids[0]), hi=min(self.hi, ids[-1]))
        if name == "entry_ms" and isinstance(value, int):
            lo, hi = _bounds(f, value)
            return _replace(
                self,
                lo=max(self.lo, EntryId(lo, 0)) if lo is not None else self.lo,
                hi=min(self.hi, EntryId(hi, MAX_ID.seq)) if hi is not None else self.hi,
            )
        if name == "published_at" and isinstance(value, datetime):
            # conservative bounds in whole ms (the literal may have microseconds): a segment is
            # skipped only if no row can match
            at = value if value.tzinfo else value.replace(tzinfo=UTC)
            us = (at - _EPOCH) // timedelta(microseconds=1)
            floor_ms, ceil_ms = us // 1000, -(-us // 1000)
            lo = floor_ms if isinstance(f, EqualTo | GreaterThan | GreaterThanOrEqual) else None
            hi = ceil_ms if isinstance(f, EqualTo | LessThan | LessThanOrEqual) else None
            return _replace(
                self,
                time_lo=lo
                if self.time_lo is None or (lo is not None and lo > self.time_lo)
                else self.time_lo,
                time_hi=hi
                if self.time_hi is None or (hi is not None and hi < self.time_hi)
                else self.time_hi,
            )
        return self

    def shard_set(self, shards: int | None) -> frozenset[int] | None:
        """Shards that may hold wanted rows, given the topic's shard count (None: unknown)."""
        allowed = self.shards
        if self.resource_ids is not None and shards:
            # here: the shard hash imports the settings (pydantic-settings), which planning
            # without a resource_id filter (every stream planner) does not need
            from eventbus.protocol.sharding import shard_of

            allowed = _meet(allowed, {shard_of(r, shards) for r in self.resource_ids})
        return allowed

    def bounded(self, after: EntryId | None, upto: EntryId | None) -> Pruning:
        """These conditions, and entry IDs after `after` and up to `upto` (either None)."""
        lo = max(self.lo, after.next()) if after is not None else self.lo
        hi = min(self.hi, upto) if upto is not None else self.hi
        return self if (lo, hi) == (self.lo, self.hi) else _replace(self, lo=lo, hi=hi)

    def added_since(self, ms: int | None) -> Pruning:
        """These conditions, and entries Redis added at or after Unix ms `ms` (None: any):
        ``startingTimestamp``."""
        if ms is None or EntryId(ms, 0) <= self.lo:
            return self
        return _replace(self, lo=EntryId(ms, 0))

    def overlaps(self, ref: SegmentRef) -> bool:
        return ref.last >= self.lo and ref.first <= self.hi


def _replace(p: Pruning, **changes: Any) -> Pruning:
    values = {f: getattr(p, f) for f in Pruning.__slots__}
    values.update(changes)
    return Pruning(**values)


def _meet(a: frozenset[Any] | None, b: set[Any]) -> frozenset[Any]:
    return frozenset(b) if a is None else a & b


def _bounds(f: Filter, v: int) -> tuple[int | None, int | None]:
    """Inclusive integer bounds of a comparison filter on an integer (ms) value."""
    if isinstance(f, EqualTo | In):
        return v, v
    if isinstance(f, GreaterThan):
        return v + 1, None
    if isinstance(f, GreaterThanOrEqual):
        return v, None
    if isinstance(f, LessThan):
        return None, v - 1
    if isinstance(f, LessThanOrEqual):
        return None, v
    return None, None
