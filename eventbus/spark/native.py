"""The native path: the archive read by Spark's own Parquet reader, the Redis tail by the source.

`read` plans the consistent cut of each topic read (``topic``, or each of ``subscribe``'s) as
``format("eventbus")`` does (`plan_topics`), then reads every cut's whole segments with one
``spark.read.parquet`` over their files (in the JVM: vectorised, with Parquet statistics for any
pushed filter, typed payload fields included; each segment's ``topic`` column tells the topics
apart) and unions the cuts' Redis tails, read by the Python source from the very same plans (the
internal ``_ranges`` option). Rows and schema are those of ``format("eventbus")``.

A typed read (``model``) takes each segment's typed columns when they were written for the
read's event types with compatible columns (`eventbus.spark.matching`: by what the segment
holds, not by the setting's text; columns a segment lacks are null, a changed column type is a
`TypedColumnConflict`); segments without such columns are read by the Python source, unioned.
Bounded reads (``startingOffsets``, ``endingOffsets``, ``startingTimestamp``) prune segments by
their first and last entry IDs and filter the rows of those that straddle a bound.

It falls back to the Python source for the whole read, and says why on the driver (a
`RuntimeWarning` and logger ``eventbus.spark``, once per read), when the JVM cannot read the
store (``memory://``, a ``store_factory``, ``s3://`` without Spark's S3A jars) or no segment has
usable typed columns. Differences from the Python path: segments are not verified (checksums,
metadata against the key) and a corrupt file fails the job (no ``_corrupt`` row for it); ``mode``
``FAILFAST`` and ``validate`` ``false`` use the Python path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel
from pyspark.sql.pandas.types import from_arrow_schema

from eventbus.protocol.ids import ZERO
from eventbus.spark.bounds import bounds_filter, literal
from eventbus.spark.jvm import kept_frame, parquet_select
from eventbus.spark.matching import (
    ReadTyping,
    SegmentTyping,
    match,
    segment_typing,
)
from eventbus.spark.objects import Objects, as_objects, parquet_footer
from eventbus.spark.options import SourceOptions, models_option
from eventbus.spark.planning import RangePart, SegmentsPart, plan_topics, ranges_option, surface
from eventbus.spark.pruning import Pruning
from eventbus.spark.schema import CORRUPT, read_schema
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment import SCHEMA as SEGMENT_SCHEMA
from eventbus.tier.typed import ERROR_COLUMN, typed_struct

log = logging.getLogger("eventbus.spark")
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()  # sessions `read` registered the source on


def read(spark: Any, options: Mapping[str, Any] | None = None, **more: Any) -> Any:
    """A DataFrame of a topic (or of ``subscribe``'s topics, each with its own cut), as
    ``spark.read.format("eventbus").options(...).load()`` gives (same options, same schema, same
    rows), with the archived part read natively when it can (see the module docstring).
    `options` and keyword options are merged; values may be given as Python values (they are
    passed as text; ``model`` also as a model class, or a mapping event type -> class, as
    `models_option` takes). Raises `ConfigError` for a bad option or a topic neither archived
    nor in Redis, and what ``load()`` raises."""
    given = {**(options or {}), **more}
    strings = {k: models_option(v) if k == "model" else _text(v) for k, v in given.items()}
    opts = SourceOptions.parse(strings)
    _register_once(spark)

    def python() -> Any:  # built only when used: each reader option is a Py4J round trip
        return spark.read.format("eventbus").options(**strings)

    why = _python_only(opts)
    if why:
        return _fallback(python, why)
    objects = as_objects(opts.open_store(entries=False))
    cuts = plan_topics(objects, opts, Pruning())  # the Python source's planner, same cut
    overlapping = [t for t, cut in cuts.items() if any(getattr(p, "floors", ()) for p in cut.parts)]
    if overlapping:
        which = ", ".join(overlapping)
        return _fallback(python, f"{which} has overlapping segments (each entry read once)")
    parts = [p for cut in cuts.values() for p in cut.parts]
    bounded = [(r, p) for p in parts if isinstance(p, SegmentsPart) for r in p.refs]
    frames: list[Any] = []
    python_refs: list[tuple[SegmentRef, SegmentsPart]] = []
    if bounded:
        try:
            frame, python_refs = _archived(spark, opts, objects, bounded)
        except _Fallback as exc:
            return _fallback(python, str(exc))
        frames += [frame] if frame is not None else []
    surface(cuts, opts.on_gap)  # after the fallbacks: they say it again
    tail = [p for p in parts if isinstance(p, RangePart)]
    tail += [_python_part(r, p) for r, p in python_refs]
    if tail or not frames:
        frames.append(python().option("_ranges", ranges_option(tail)).load())
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


class _Fallback(Exception):
    """The whole read goes to the Python source: the text says why."""


Bounded = Sequence[tuple[SegmentRef, SegmentsPart]]


def _archived(
    spark: Any, opts: SourceOptions, objects: Objects, bounded: Bounded
) -> tuple[Any, list[tuple[SegmentRef, SegmentsPart]]]:
    """The native frame of the segments of `bounded` (None: none of them), and those the Python
    source reads instead (without usable typed columns for a typed read: said once on the
    driver). Raises `_Fallback` when Spark cannot read the store or no segment has usable typed
    columns, `TypedColumnConflict` for a changed column type."""
    models = tuple((opts.models() or {}).items())
    # the footers' typed columns are fetched while the JVM builds the relation (it waits for
    # Spark most of that time): matched before the frame is returned, never skipped
    footers = _typings(objects, [r for r, _ in bounded]) if models else None
    frame, failed = _attempt(spark, opts, bounded, models, frozenset())
    python_refs: list[tuple[SegmentRef, SegmentsPart]] = []
    if footers is not None:
        found = match(_read_typing(models), [f.result() for f in footers])
        if failed is None and (found.python or found.masked):
            python_refs = [bounded[i] for i in found.python]
            native = [bounded[i] for i in found.native]
            frame, failed = (
                _attempt(spark, opts, native, models, found.masked) if native else (None, None)
            )
        if found.why and not found.native:
            raise _Fallback(found.why)
        if found.why and failed is None:
            _warn(f"{found.why}: those segments are read through the Python source")
    if failed:
        raise _Fallback(failed)
    return frame, python_refs


def _attempt(
    spark: Any,
    opts: SourceOptions,
    bounded: Bounded,
    models: tuple[tuple[str | None, type[BaseModel]], ...],
    masked: frozenset[str],
) -> tuple[Any, str | None]:
    """`_segments`' frame and None, or None and why the JVM could not build it (it cannot
    list or read the files: a py4j or analysis error)."""
    try:
        return _segments(spark, opts, bounded, models, masked), None
    except Exception as exc:
        return None, f"Spark cannot read {opts.store}: {_first_line(exc)}"


def _python_part(ref: SegmentRef, part: SegmentsPart) -> RangePart:
    """A Redis-tail-style part that reads segment `ref` alone, within `part`'s bounds, through
    the Python source (no ``XRANGE``: its checkpoint is the segment's end)."""
    after = part.lo.prev() if part.lo > ZERO else None
    return RangePart(ref.topic, ref.shard, after, min(ref.last, part.hi), ref.last, (ref,))


def _python_only(opts: SourceOptions) -> str | None:
    if opts.table != "events":
        return "option table=gaps"
    if opts.mode == "FAILFAST" or not opts.validate:
        return "mode FAILFAST / validate false"
    if opts.store_factory:
        return "a store_factory store is read through obstore only"
    if opts.store.startswith("memory://"):
        return "a memory:// store lives in the Python process"
    if not opts.native:
        return "option native=false"
    return None


def _typings(objects: Objects, refs: Sequence[SegmentRef]) -> list[Future[SegmentTyping]]:
    """Each of `refs`' footer's typed columns (`segment_typing`), fetched and parsed by the
    footer threads (`_footer_pool`): futures, in `refs`' order, whose result raises what
    `parquet_footer` raises."""
    pool = _footer_pool()
    return [pool.submit(_typing, objects, ref) for ref in refs]


def _typing(objects: Objects, ref: SegmentRef) -> SegmentTyping:
    return segment_typing(ref.key, parquet_footer(objects, ref))


@functools.lru_cache(maxsize=32)
def _read_typing(models: tuple[tuple[str | None, type[BaseModel]], ...]) -> ReadTyping:
    """`ReadTyping` of `models` (event type, class pairs), built once per models."""
    return ReadTyping.of(dict(models))


@functools.cache
def _footer_pool() -> ThreadPoolExecutor:
    """The threads that fetch footers (ranged GETs, S3's latency in parallel), started once:
    starting 8 threads per read cost more than reading 16 local footers."""
    return ThreadPoolExecutor(8, thread_name_prefix="eventbus-footers")


def _segments(
    spark: Any,
    opts: SourceOptions,
    bounded: Sequence[tuple[SegmentRef, SegmentsPart]],
    models: tuple[tuple[str | None, type[BaseModel]], ...],
    masked: frozenset[str],
) -> Any:
    """The segments of `bounded` (each with its planned part) through Spark's Parquet reader, as
    the columns of a read of `models` (event type, class pairs; none: a raw read): one relation
    with the segments' schema given (no inference job), then one projection that renames three
    columns, turns ``event_time_ms`` into ``published_at`` and nulls the `masked` columns on
    rows of types the read does not model for them (`_columns`), kept for reads of the same
    files (`kept_frame`: a stream's micro-batches within the same segments); rows outside a
    part's entry-ID bounds (``startingOffsets``, ``endingOffsets``, ``startingTimestamp``) are
    filtered out."""
    root = _root(opts.store)
    files = tuple((r.key, r.size) for r, _ in bounded)  # (a rewritten file: another size)

    def build() -> Any:
        given, exprs = _columns(models, masked)
        return parquet_select(spark, given, [f"{root}/{k}" for k, _ in files], exprs)

    df = kept_frame(spark, (root, files, models, masked), build)
    where = bounds_filter(bounded)
    return df.where(where) if where else df


@functools.lru_cache(maxsize=32)
def _columns(
    models: tuple[tuple[str | None, type[BaseModel]], ...],
    masked: frozenset[str] = frozenset(),
) -> tuple[Any, tuple[str, ...]]:
    """The segments' schema to give Spark's reader and the projection to the read's columns
    (`read_schema`), for `models` (event type, class pairs), typed columns in `masked` (and
    ``_corrupt``: `CORRUPT_MASK`) null on rows of event types the read does not model for
    them: built once per models and masks."""
    struct = typed_struct(dict(models)) if models else None
    schema = read_schema(dict(models) if models else None)
    # the fixed columns are in every segment; a typed column a segment lacks (an older model
    # version) is null in its rows; the columns are given in the read's order, so that the
    # projection is plain names and renames (a cast, even to the same type, costs the analyzer)
    fields = {f.name: f for f in [pa.field("topic", pa.string()), *list(SEGMENT_SCHEMA)[1:]]}
    if struct is not None:
        fields |= {f.name: f for f in [*struct, pa.field(ERROR_COLUMN, pa.string())]}
    renamed = {"published_at": "event_time_ms", "payload": "data"}
    if struct is not None:
        renamed[CORRUPT] = ERROR_COLUMN
    wanted = [
        fields[n] for n in (renamed.get(f.name, f.name) for f in schema.fields) if n in fields
    ]
    given = from_arrow_schema(pa.schema(wanted))
    have = {f.name: f.dataType for f in given.fields}
    typing = _read_typing(models) if models else None
    # one SQL expression per column, sent with the paths in a fixed number of Py4J round trips
    # (`parquet_select`): a Column built per field (col, cast, alias) was three round trips each
    exprs = []
    for field in schema.fields:
        name, source = field.name, renamed.get(field.name, field.name)
        if name == "published_at":
            exprs.append(f"timestamp_millis({source}) AS {_quoted(name)}")
        elif typing is not None and name in masked:  # (`CORRUPT_MASK` is ``_corrupt``)
            types = typing.keys if name == CORRUPT else typing.fields[name]
            listed = ", ".join(literal(t) for t in sorted(types))
            exprs.append(
                f"CASE WHEN event_type IN ({listed}) THEN {_quoted(source)} END AS {_quoted(name)}"
            )
        elif have.get(source) == field.dataType:
            alias = "" if source == name else f" AS {_quoted(name)}"
            exprs.append(_quoted(source) + alias)
        else:  # another type (not seen: the types are the read's), or a column no segment has
            value = _quoted(source) if source in have else "NULL"  # (``_corrupt`` of a raw read)
            exprs.append(f"CAST({value} AS {field.dataType.simpleString()}) AS {_quoted(name)}")
    return given, tuple(exprs)


def _quoted(name: str) -> str:
    """`name` as a Spark SQL identifier (backticks, a backtick doubled)."""
    return "`" + name.replace("`", "``") + "`"


def _root(store: str) -> str:
    """The store URL as Hadoop names it: ``file:`` for a folder, ``s3a://`` for S3."""
    if store.startswith(("s3://", "s3a://")):
        return "s3a://" + store.split("://", 1)[1].rstrip("/")
    path = store.removeprefix("file://") if store.startswith("file://") else store
    return _folder_uri(path, "" if os.path.isabs(path) else os.getcwd())


@functools.lru_cache(maxsize=64)
def _folder_uri(path: str, cwd: str) -> str:
    """The ``file:`` URI of folder `path` (relative to `cwd` when not absolute), symbolic links
    resolved once: resolving is a system call per path component."""
    return Path(cwd, path).resolve().as_uri()


def _register_once(spark: Any) -> None:
    """`register` on a session not seen yet: registering pickles the source class and sends it
    to the JVM (about a tenth of a second), once per session is enough."""
    if spark not in _REGISTERED:
        from eventbus.spark import register

        register(spark)
        _REGISTERED.add(spark)


def _fallback(python: Callable[[], Any], why: str) -> Any:
    _warn(f"eventbus.spark.read falls back to the Python source: {why}")
    return python().load()


def _warn(text: str) -> None:
    """Say `text` on the driver, once per read: logger ``eventbus.spark`` and a
    `RuntimeWarning` (this runs in the driver's process)."""
    log.warning(text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value)
    return str(value)
