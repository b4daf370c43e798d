"""The row filter of a bounded native read (``startingOffsets``, ``endingOffsets``,
``startingTimestamp``): the rows of segments that straddle a read's bounds, kept within them, as
one Spark SQL condition of fixed size (`bounds_filter`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from eventbus.protocol.ids import ZERO, EntryId
from eventbus.spark.planning import SegmentsPart
from eventbus.spark.reading import INT64_MAX
from eventbus.tier.layout import SegmentRef


def bounds_filter(bounded: Sequence[tuple[SegmentRef, SegmentsPart]]) -> str | None:
    """A Spark SQL condition keeping, in each shard whose segments reach past its part's bounds,
    the rows within them (None: no segment does). Entry IDs compare as (``entry_ms``,
    ``entry_seq``). Its size does not grow with the shard count: the bounds are array literals
    indexed by ``shard`` (`_shard_bounds`), and a read of several topics picks its topic's
    arrays with one ``CASE topic``. (A condition per shard made a filter of 16 shards read 0.09
    x the unbounded read's rate; `stress/spark_bench.py`'s ``bounded_native``.)

    It starts with the range of ``entry_ms`` any kept row has (`_time_range`): two plain
    comparisons, which Spark pushes to its Parquet reader (row groups, and pages where the file
    has a page index, outside them are skipped) and which drop most rows outside the bounds
    before the per-shard comparisons; Spark evaluates them first, and the rest only for rows
    they keep.

    Where every bound and kept row has ``entry_ms`` below 2**43 (the year 2248) and every bound
    an ``entry_seq`` below 2**20 - 1 (entries Redis added in one ms), an entry ID compares as
    one ``bigint`` (`_KEY`: ``entry_ms`` shifted by 20 bits plus ``entry_seq`` clamped to
    2**20 - 1, exact for such bounds): two array lookups a row instead of up to four and six
    comparisons, and a shorter text for Spark to parse (`stress/spark_bench.py`'s
    ``bounded_native``, docs/spark.md). Other bounds compare (``entry_ms``, ``entry_seq``)."""
    by_topic: dict[str, dict[int, tuple[EntryId, EntryId]]] = {}
    for ref, part in bounded:
        if ref.first < part.lo or ref.last > part.hi:
            by_topic.setdefault(ref.topic, {})[ref.shard] = (part.lo, part.hi)
    if not by_topic:
        return None
    lo, hi = _time_range(bounded)
    pack = hi < _MS_LIMIT and all(
        _packs(first) and (_packs(last) or last >= _NO_END)
        for bounds in by_topic.values()
        for first, last in bounds.values()
    )
    conds = {topic: _shard_bounds(bounds, pack) for topic, bounds in by_topic.items()}
    if len({ref.topic for ref, _ in bounded}) == 1:
        fine = next(iter(conds.values()))
    else:
        whens = " ".join(f"WHEN {literal(t)} THEN {c}" for t, c in sorted(conds.items()))
        fine = f"(CASE topic {whens} ELSE true END)"
    return f"entry_ms >= {lo}L AND entry_ms <= {hi}L AND {fine}"


def _time_range(bounded: Sequence[tuple[SegmentRef, SegmentsPart]]) -> tuple[int, int]:
    """The first and last ``entry_ms`` of any row a read of `bounded` keeps: a segment's rows
    lie within its first and last entry IDs, the kept ones also within its part's bounds."""
    lo = min(max(ref.first, part.lo).ms for ref, part in bounded)
    hi = max(min(ref.last, part.hi).ms for ref, part in bounded)
    return lo, min(hi, INT64_MAX)


# an entry ID as one bigint: exact for bounds with ``entry_seq`` below `_SEQ_CAP` and rows and
# bounds with ``entry_ms`` below `_MS_LIMIT` (a row's seq at or above the cap sorts after any
# such bound of its ms, as it should; no overflow: Spark's ANSI mode would fail the job)
_SEQ_BITS = 20
_SEQ_CAP = (1 << _SEQ_BITS) - 1
_MS_LIMIT = 1 << (63 - _SEQ_BITS)
_NO_END = EntryId(INT64_MAX, INT64_MAX)  # a bound at or after it: no end (the columns' most)
_KEY = f"(entry_ms * {1 << _SEQ_BITS}L + least(entry_seq, {_SEQ_CAP}L))"


def _packs(bound: EntryId) -> bool:
    return bound.seq < _SEQ_CAP and bound.ms < _MS_LIMIT


def _shard_bounds(bounds: Mapping[int, tuple[EntryId, EntryId]], pack: bool = False) -> str:
    """The condition of one topic's rows: in a shard of `bounds` (shard -> first and last entry
    ID wanted, inclusive), within them; in any other shard, kept. Per shard, the bound parts
    are elements of ``array`` literals (`get` of the ``shard`` column): with `pack`, the two
    bounds as `_KEY` values (see `bounds_filter`), else their four parts; IDs beyond int64
    (`MAX_ID`, an ``EntryId.prev``) are clamped: the columns never exceed it."""
    top = max(bounds) + 1
    free = (ZERO, _NO_END)  # a shard not bounded: every row kept
    lows = [bounds.get(s, free)[0] for s in range(top)]
    highs = [bounds.get(s, free)[1] for s in range(top)]
    if pack:
        keys = _array((lo.ms << _SEQ_BITS) + lo.seq for lo in lows)
        tops = _array((hi.ms << _SEQ_BITS) + hi.seq if hi < _NO_END else INT64_MAX for hi in highs)
        return (
            f"(shard < 0 OR shard >= {top} OR "
            f"{_KEY} BETWEEN get({keys}, shard) AND get({tops}, shard))"
        )
    inside = []
    if any(lo > ZERO for lo in lows):
        ms, seq = _array(lo.ms for lo in lows), _array(lo.seq for lo in lows)
        inside.append(
            f"(entry_ms > get({ms}, shard) OR "
            f"(entry_ms = get({ms}, shard) AND entry_seq >= get({seq}, shard)))"
        )
    if any(hi < free[1] for hi in highs):
        ms, seq = _array(hi.ms for hi in highs), _array(hi.seq for hi in highs)
        inside.append(
            f"(entry_ms < get({ms}, shard) OR "
            f"(entry_ms = get({ms}, shard) AND entry_seq <= get({seq}, shard)))"
        )
    if not inside:
        return "true"
    return f"(shard < 0 OR shard >= {top} OR ({' AND '.join(inside)}))"


def _array(values: Iterable[int]) -> str:
    """A Spark SQL ``array<bigint>`` literal of `values`, each clamped to int64."""
    return "array(" + ", ".join(f"{min(v, INT64_MAX)}L" for v in values) + ")"


def literal(text: str) -> str:
    """`text` as a Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
