"""What a read covers: the consistent cut with Redis, as Spark tasks; both batch read paths plan
with `plan_topics` (``format("eventbus")``'s `BatchReader` and `eventbus.spark.native.read`).

**The cut** (`plan_read` with Redis): per shard, the offloader's checkpoint is read first,
then the segments are listed, then the stream's last entry ``S``; ``C`` is the checkpoint, or
the last listed segment's end when later (`archived_upto`). Segments give entries up to ``C``,
``XRANGE (C, S]`` the rest: disjoint, and together every entry of the shard up to ``S``.
Which shards and entry IDs are wanted is `eventbus.spark.pruning`'s; reading the parts is
`eventbus.spark.reading`'s job (the native path reads the segment parts with Spark's own
Parquet reader).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import InputPartition

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.protocol.keys import Keys
from eventbus.spark.objects import Objects
from eventbus.spark.options import SourceOptions, batch_offsets
from eventbus.spark.pruning import Pruning
from eventbus.spark.surfacing import surface_beyond, surface_gaps
from eventbus.tier.layout import SegmentRef, parse_segment_key


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


def plan_topics(objects: Objects, opts: SourceOptions, pruning: Pruning) -> dict[str, Cut]:
    """The cut (`plan_read`) of each topic a batch read of `opts` reads (``subscribe``'s, else
    ``topic``), within `pruning` and ``startingTimestamp``, each bounded by its
    ``startingOffsets`` / ``endingOffsets``: the one planner of both batch read paths. Opens
    and closes a Redis client when ``redis_url`` is given. Raises what `plan_read` raises, and
    `ConfigError` for bad offsets."""
    redis = opts.redis()
    whole = pruning.added_since(opts.starting_timestamp)
    try:
        return {
            topic: plan_read(
                objects,
                topic,
                whole,
                starts=batch_offsets(opts, topic, "startingOffsets"),
                ends=batch_offsets(opts, topic, "endingOffsets"),
                redis=redis,
                keys=opts.keys(),
                shards=opts.shards,
                pack_bytes=opts.pack_bytes,
            )
            for topic in opts.subscribed or (opts.topic,)
        }
    finally:
        if redis is not None:
            redis.close()


def surface(cuts: Mapping[str, Cut], on_gap: str | None) -> None:
    """Say on the driver (or raise, with ``onGap`` ``fail``) what each topic's cut cannot give:
    gap records it overlaps, starting offsets past the last entry (`eventbus.spark.surfacing`)."""
    for topic, cut in cuts.items():
        surface_gaps(topic, cut.gaps, on_gap)
        surface_beyond(topic, cut.beyond, on_gap)


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
    starts, ends = starts or {}, ends or {}
    count = shard_count(redis, keys, topic, shards)
    present = set(objects.shards(topic)) | set(range(count or 0))
    if not present:  # a misspelled topic must not read as an empty one
        raise unknown_topic(topic, objects, redis)
    check_bounds(topic, present, starts, ends)
    allowed = pruning.shard_set(count)
    chosen = sorted(s for s in present if allowed is None or s in allowed)
    cps = checkpoints(redis, keys, topic, chosen) if redis is not None else {}
    listed = {s: objects.segments(topic, s) for s in chosen}
    lasts = last_ids(redis, keys, topic, chosen) if redis is not None else {}
    cut = Cut([], [])
    for s in chosen:
        bounded = pruning.bounded(starts.get(s), ends.get(s))
        start = archived_upto(cps.get(s), listed[s]) if redis is not None else None
        cut.parts += _segment_parts(listed[s], bounded, start, redis is not None, pack_bytes)
        last = lasts.get(s)
        head = max(
            [x for x in (last, start, *(r.last for r in listed[s][-1:])) if x is not None],
            default=ZERO,
        )
        begin = starts.get(s)
        if begin is not None and begin > head and (redis is not None or listed[s]):
            cut.beyond.append(f"shard {s} starts after {begin}, its last entry is {head}")
        if last is not None and (start is None or last > start):
            tail = _tail_part(topic, s, bounded, start, last)
            cut.parts += [tail] if tail is not None else []
        if listed[s] or s in lasts or s in cps:
            cut.gaps += [g for g in objects.gaps(topic, s) if _gap_overlaps(g, bounded)]
    return cut


def _segment_parts(
    listed: Sequence[SegmentRef],
    pruning: Pruning,
    start: EntryId | None,
    with_redis: bool,
    pack_bytes: int,
) -> list[SegmentsPart]:
    """The segment tasks of one shard's `listed` segments: those `pruning` may want, each
    entry once (`overlap_floors`), with Redis (`with_redis`) only those up to where the
    archive ends (`start`), packed up to `pack_bytes` a task."""
    floors = overlap_floors(listed)
    refs = [r for r in listed if r.key in floors and pruning.overlaps(r)]
    if with_redis:
        refs = [r for r in refs if start is not None and r.last <= start]
    overlapping = any(floors.values())
    return [
        SegmentsPart(
            tuple(group),
            pruning.lo,
            pruning.hi,
            pruning.time_lo,
            pruning.time_hi,
            tuple(floors[r.key] for r in group) if overlapping else (),
        )
        for group in _pack(refs, pack_bytes)
    ]


def _tail_part(
    topic: str, shard: int, pruning: Pruning, start: EntryId | None, last: EntryId
) -> RangePart | None:
    """The Redis task of one shard: its entries after the archive's end (`start`) up to the
    stream's `last`, within `pruning` (None: none wanted)."""
    upto = min(last, pruning.hi)
    floor = pruning.lo.prev() if pruning.lo > ZERO else None
    after = start if floor is None else floor if start is None else max(start, floor)
    if after is None or upto > after:
        return RangePart(topic, shard, after, upto, start)
    return None


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
