"""What a read covers: pruning, the consistent cut with Redis, and reading one shard's range.

**Pruning** (`Pruning.from_filters`): Spark's pushed filters on ``shard``, ``resource_id``
(through the shard hash), ``entry_id`` (equality), ``entry_ms`` (ranges) and ``published_at``
(ranges, checked against each segment's Parquet statistics) narrow the shards and entry-ID
range; segments outside are never fetched. Every filter is still handed back to Spark, which
applies it to the rows: pruning only skips what cannot match.

**The cut** (`plan_read` with Redis): per shard, the offloader's checkpoint is read first,
then the segments are listed, then the stream's last entry ``S``; ``C`` is the checkpoint, or
the last listed segment's end when later (`archived_upto`). Segments give entries up to ``C``,
``XRANGE (C, S]`` the rest: disjoint, and together every entry of the shard up to ``S``.

Reading the parts is `eventbus.spark.reading`'s job.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.protocol.keys import Keys
from eventbus.protocol.sharding import shard_of
from eventbus.spark.objects import Objects
from eventbus.tier.errors import TierError
from eventbus.tier.layout import SegmentRef, parse_segment_key

log = logging.getLogger("eventbus.spark")

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


@dataclass(frozen=True)
class SegmentsPart(InputPartition):
    """A Spark task: consecutive segments of one shard, rows in [`lo`, `hi`]; `floors[i]`, when
    set, drops the rows of `refs[i]` up to it (an earlier, overlapping segment holds them)."""

    refs: tuple[SegmentRef, ...]
    lo: EntryId
    hi: EntryId
    time_lo: int | None = None
    time_hi: int | None = None
    floors: tuple[EntryId | None, ...] = ()

    def floor(self, i: int) -> EntryId | None:
        return self.floors[i] if self.floors else None


@dataclass(frozen=True)
class RangePart(InputPartition):
    """A Spark task: shard `shard`'s entries in (`after`, `upto`], archived ones up to `cp`
    from segments, the rest from Redis (see `read_range`)."""

    topic: str
    shard: int
    after: EntryId | None
    upto: EntryId
    cp: EntryId | None = None
    refs: tuple[SegmentRef, ...] = field(default=())


@dataclass(slots=True)
class Cut:
    """A planned read: its Spark tasks, and the gap records overlapping it."""

    parts: list[InputPartition]
    gaps: list[dict[str, Any]]
    beyond: list[str] = field(default_factory=list)  # shards whose start is past their end


def checkpoints(redis: Any, keys: Keys, topic: str, shards: Sequence[int]) -> dict[int, EntryId]:
    """The offloader's checkpoint (last archived ID) of each of `shards` that has one."""
    raw = redis.hmget(keys.checkpoints(topic), [str(s) for s in shards]) if shards else []
    return {s: parse_id(v) for s, v in zip(shards, raw, strict=True) if v is not None}


def last_ids(redis: Any, keys: Keys, topic: str, shards: Sequence[int]) -> dict[int, EntryId]:
    """The last entry ID in each of `shards`' streams (shards with an empty stream: absent)."""
    pipe = redis.pipeline(transaction=False)
    for s in shards:
        pipe.xrevrange(keys.stream(topic, s), "+", "-", count=1)
    out = {}
    for s, reply in zip(shards, pipe.execute(), strict=True):
        if reply:
            out[s] = parse_id(reply[0][0])
    return out


def shard_count(redis: Any, keys: Keys, topic: str, given: int | None) -> int | None:
    """The topic's shard count: `given`, else the topic registry in Redis, else None."""
    if given is not None or redis is None:
        return given
    raw = redis.hget(keys.topics(), topic)
    return int(raw) if raw is not None else None


def unknown_topic(topic: str, objects: Objects, redis: Any) -> ConfigError:
    """The error for `topic` found neither in the archive (`objects`) nor in Redis's topic
    registry (`redis`, None without ``redis_url``): a misspelled topic, never an empty read."""
    where = "nor in Redis's topic registry" if redis is not None else "(and no redis_url given)"
    return ConfigError(f"topic {topic!r} is neither in the archive at {objects!r} {where}")


def plan_read(
    objects: Objects,
    topic: str,
    pruning: Pruning,
    *,
    redis: Any = None,
    keys: Keys | None = None,
    shards: int | None = None,
    pack_bytes: int = 0,
    starts: Mapping[int, EntryId] | None = None,
    ends: Mapping[int, EntryId] | None = None,
) -> Cut:
    """Plan a batch read of `topic` (see the module docstring for the cut). Segments of a shard
    smaller than `pack_bytes` together share a task. Raises `StoreError`, and `ConfigError` for
    a topic with no segment and (with `redis`) not registered. `starts` / `ends` bound shards'
    rows: after `starts[shard]`, up to `ends[shard]` (a batch read's offsets)."""
    keys = keys or Keys()
    count = shard_count(redis, keys, topic, shards)
    present = set(objects.shards(topic)) | set(range(count or 0))
    if not present:  # a misspelled topic must not read as an empty one
        raise unknown_topic(topic, objects, redis)
    check_bounds(topic, present, starts or {}, ends or {})
    allowed = pruning.shard_set(count)
    chosen = sorted(s for s in present if allowed is None or s in allowed)
    cps = checkpoints(redis, keys, topic, chosen) if redis is not None else {}
    parts: list[InputPartition] = []
    gaps: list[dict[str, Any]] = []
    per_shard = {s: objects.segments(topic, s) for s in chosen}
    lasts = last_ids(redis, keys, topic, chosen) if redis is not None else {}
    whole = pruning
    beyond = []
    for s in chosen:
        pruning = whole.bounded((starts or {}).get(s), (ends or {}).get(s))
        start = archived_upto(cps.get(s), per_shard[s]) if redis is not None else None
        floors = overlap_floors(per_shard[s])
        refs = [r for r in per_shard[s] if r.key in floors and pruning.overlaps(r)]
        if redis is not None:
            refs = [r for r in refs if start is not None and r.last <= start]
        parts += [
            SegmentsPart(
                tuple(group),
                pruning.lo,
                pruning.hi,
                pruning.time_lo,
                pruning.time_hi,
                tuple(floors[r.key] for r in group) if any(floors.values()) else (),
            )
            for group in _pack(refs, pack_bytes)
        ]
        last = lasts.get(s)
        head = max(
            [x for x in (last, start, *(r.last for r in per_shard[s][-1:])) if x is not None],
            default=ZERO,
        )
        begin = (starts or {}).get(s)
        if begin is not None and begin > head and (redis is not None or per_shard[s]):
            beyond.append(f"shard {s} starts after {begin}, its last entry is {head}")
        if last is not None and (start is None or last > start):
            upto = min(last, pruning.hi)
            floor = pruning.lo.prev() if pruning.lo > EntryId(0, 0) else None
            after = start if floor is None else floor if start is None else max(start, floor)
            if after is None or upto > after:
                parts.append(RangePart(topic, s, after, upto, start))
        if per_shard[s] or s in lasts or s in cps:
            gaps += [g for g in objects.gaps(topic, s) if _gap_overlaps(g, pruning)]
    return Cut(parts, gaps, beyond)


def check_bounds(
    topic: str,
    present: set[int],
    starts: Mapping[int, EntryId],
    ends: Mapping[int, EntryId],
) -> None:
    """Refuse (`ConfigError`) batch offsets naming a shard `topic` does not have (`present`) or
    ending before they start, as Kafka's source refuses an unknown partition and an end offset
    before the start."""
    unknown = sorted((set(starts) | set(ends)) - present)
    if unknown:
        raise ConfigError(
            f"options startingOffsets/endingOffsets: topic {topic!r} has no shard "
            f"{', '.join(map(str, unknown))} (its shards: {', '.join(map(str, sorted(present)))})"
        )
    for s in sorted(set(starts) & set(ends)):
        if ends[s] < starts[s]:
            raise ConfigError(
                f"options startingOffsets/endingOffsets: topic {topic!r} shard {s} ends at "
                f"{ends[s]}, before it starts after {starts[s]}"
            )


def fail_or_warn(text: str, on_gap: str | None) -> None:
    """Raise `TierError` with `text` when ``on_gap == "fail"``, else say it on the driver: a
    warning on logger ``eventbus.spark`` and a `RuntimeWarning` (pointing at the read's
    caller of ``surface_*``)."""
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


def overlap_floors(refs: Sequence[SegmentRef]) -> dict[str, EntryId | None]:
    """Per key of `refs` (one shard's listing, in key order) to read: None, or the entry ID up
    to which its rows are dropped, because an earlier segment holds them (a forged segment, or
    an offloader's leftover). Segments wholly inside earlier ones are left out. Each entry is
    then read once, as `eventbus.tier.replay.iter_shard` gives it."""
    out: dict[str, EntryId | None] = {}
    high: EntryId | None = None
    for ref in refs:
        if high is not None and ref.last <= high:
            continue
        out[ref.key] = high if high is not None and ref.first <= high else None
        high = ref.last if high is None else max(high, ref.last)
    return out


def archived_upto(cp: EntryId | None, refs: Sequence[SegmentRef]) -> EntryId | None:
    """Where a shard's archive ends: its checkpoint, or the last listed segment's end when that
    is later (a segment stored but not yet committed, or a checkpoint Redis lost). Entries up to
    it are read from segments, after it from Redis: both hold the entries of such a segment,
    since the offloader trims only below its checkpoint."""
    last = refs[-1].last if refs else None
    if cp is None or (last is not None and last > cp):
        return last
    return cp


def _gap_overlaps(gap: dict[str, Any], pruning: Pruning) -> bool:
    try:
        after, before = parse_id(gap["after"]), parse_id(gap["before"])
    except (KeyError, ConfigError):
        return True
    return before > pruning.lo and after < pruning.hi


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


def _pack(refs: list[SegmentRef], pack_bytes: int) -> Iterator[list[SegmentRef]]:
    group: list[SegmentRef] = []
    size = 0
    for ref in refs:
        if group and size + ref.size > pack_bytes:
            yield group
            group, size = [], 0
        group.append(ref)
        size += ref.size
    if group:
        yield group


def ranges_option(parts: Sequence[RangePart]) -> str:
    """The ``_ranges`` option: the planned Redis-tail parts (and segments the Python source
    reads for the native path) as JSON."""
    return json.dumps(
        [[p.topic, p.shard, _id(p.after), str(p.upto), _id(p.cp), _refs(p)] for p in parts]
    )


def _refs(part: RangePart) -> list[list[Any]]:
    return [[r.key, r.size] for r in part.refs]


def parse_ranges(text: str) -> list[RangePart]:
    """`ranges_option`'s parts back."""
    out = []
    for t, s, a, u, c, keys in json.loads(text):
        refs = tuple(parse_segment_key(k, size) for k, size in keys)
        out.append(
            RangePart(
                t,
                int(s),
                parse_id(a) if a else None,
                parse_id(u),
                parse_id(c) if c else None,
                tuple(r for r in refs if r is not None),
            )
        )
    return out


def _id(value: Any) -> str | None:
    return None if value is None else str(value)
