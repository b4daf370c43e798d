"""The native path: the archive read by Spark's own Parquet reader, the Redis tail by the source.

`read` plans the consistent cut of each topic read (``topic``, or each of ``subscribe``'s) as
``format("eventbus")`` does (`plan_read`), then reads every cut's whole segments with one
``spark.read.parquet`` over their files (in the JVM: vectorised, with Parquet statistics for any
pushed filter, typed payload fields included; each segment's ``topic`` column tells the topics
apart) and unions the cuts' Redis tails, read by the Python source from the very same plans (the
internal ``_ranges`` option). Rows and schema are those of ``format("eventbus")``.

It falls back to the Python source, and logs why once per reason, when the JVM cannot read the
store (``memory://``, a ``store_factory``, ``s3://`` without Spark's S3A jars) or when a typed read
(``model``) covers segments whose typed columns were not written for the same models
(`eventbus.tier.typed`): those need ``data`` decoded in Python. Differences from the Python path:
segments are not verified (checksums, metadata against the key) and a corrupt file fails the job
(no ``_corrupt`` row for it); ``mode`` ``FAILFAST`` and ``validate`` ``false`` use the Python path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel
from pyspark.sql.pandas.types import from_arrow_schema

from eventbus.spark.jvm import parquet_select
from eventbus.spark.objects import Objects, as_objects
from eventbus.spark.options import SourceOptions, models_option
from eventbus.spark.planning import Pruning, RangePart, SegmentsPart, plan_read, surface_gaps
from eventbus.spark.reading import parquet_footer
from eventbus.spark.schema import CORRUPT, read_schema
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment import SCHEMA as SEGMENT_SCHEMA
from eventbus.tier.typed import ERROR_COLUMN, TypedPayloads

log = logging.getLogger("eventbus.spark")
_SAID: set[str] = set()
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()  # sessions `read` registered the source on
_Version = tuple[str | None, str | None]  # a segment footer's typed models and typed version


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

    why = _python_only(opts, strings)
    if why:
        return _fallback(python, why)
    objects = as_objects(opts.open_store())
    redis = opts.redis()
    try:  # one cut per topic read (``subscribe``'s, else ``topic``), as the Python source plans
        cuts = {
            topic: plan_read(
                objects, topic, Pruning(), redis=redis, keys=opts.keys(), shards=opts.shards
            )
            for topic in opts.subscribed
        }
    finally:
        if redis is not None:
            redis.close()
    parts = [p for cut in cuts.values() for p in cut.parts]
    segment_parts = [p for p in parts if isinstance(p, SegmentsPart)]
    overlapping = [t for t, cut in cuts.items() if any(getattr(p, "floors", ()) for p in cut.parts)]
    if overlapping:
        which = ", ".join(overlapping)
        return _fallback(python, f"{which} has overlapping segments (each entry read once)")
    refs = [r for p in segment_parts for r in p.refs]
    models = opts.models()
    typed = _typed_payloads(tuple(models.items())) if models else None
    # the footers' typed versions are fetched while the JVM builds the relation (it waits for
    # Spark most of that time): checked before the frame is returned, never skipped
    footers = _typed_versions(objects, refs) if refs and typed is not None else None
    frames = []
    failed = None
    if refs:
        try:
            frames.append(_segments(spark, opts, refs, tuple((models or {}).items())))
        except Exception as exc:  # the JVM cannot list or read the files (py4j / analysis)
            failed = f"Spark cannot read {opts.store}: {_first_line(exc)}"
    if footers is not None and typed is not None:
        why = _untyped([f.result() for f in footers], typed)
        if why:
            return _fallback(python, why)
    if failed:
        return _fallback(python, failed)
    for topic, cut in cuts.items():  # after the fallbacks: they say it again
        surface_gaps(topic, cut.gaps, opts.on_gap)
    tail = [p for p in parts if isinstance(p, RangePart)]
    if tail or not frames:
        frames.append(python().option("_ranges", ranges_option(tail)).load())
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


def ranges_option(parts: Sequence[RangePart]) -> str:
    """The ``_ranges`` option: the planned Redis-tail parts as JSON."""
    return json.dumps([[p.topic, p.shard, _id(p.after), str(p.upto), _id(p.cp)] for p in parts])


def parse_ranges(text: str) -> list[RangePart]:
    """`ranges_option`'s parts back."""
    from eventbus.protocol.ids import parse_id

    return [
        RangePart(t, int(s), parse_id(a) if a else None, parse_id(u), parse_id(c) if c else None)
        for t, s, a, u, c in json.loads(text)
    ]


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


def _python_only(opts: SourceOptions, strings: Mapping[str, str]) -> str | None:
    if opts.table != "events":
        return "option table=gaps"
    if opts.mode == "FAILFAST" or not opts.validate:
        return "mode FAILFAST / validate false"
    if opts.store_factory:
        return "a store_factory store is read through obstore only"
    if opts.store.startswith("memory://"):
        return "a memory:// store lives in the Python process"
    if opts.starting_offsets != "earliest" or opts.ending_offsets != "latest":
        return "startingOffsets / endingOffsets bound rows inside segments"
    if str(strings.get("native", "true")).lower() == "false":
        return "option native=false"
    return None


def _typed_versions(objects: Objects, refs: Sequence[SegmentRef]) -> list[Future[_Version]]:
    """Each of `refs`' footer's (typed models, typed version), fetched and parsed by the footer
    threads (`_footer_pool`): futures, in `refs`' order, whose result raises what
    `parquet_footer` raises."""
    pool = _footer_pool()
    return [pool.submit(_typed_version, objects, ref) for ref in refs]


def _typed_version(objects: Objects, ref: SegmentRef) -> _Version:
    meta = parquet_footer(objects, ref).metadata or {}
    models = meta.get(b"eventbus.typed_models")
    found = meta.get(b"eventbus.typed_version")
    return (models.decode() if models else None, found.decode() if found else None)


def _untyped(found: Sequence[_Version], typed: TypedPayloads) -> str | None:
    """Why segments whose footers name `found` (models, typed version) cannot give the typed
    columns of `typed` natively (None: all can): each must name the same models and version."""
    other = sum(1 for f in found if f != (typed.spec, typed.version))
    if other:
        return (
            f"{other} of {len(found)} segments have no typed columns for models {typed.spec} "
            "(written before the topic's models were registered, or with other models)"
        )
    return None


@functools.lru_cache(maxsize=32)
def _typed_payloads(models: tuple[tuple[str | None, type[BaseModel]], ...]) -> TypedPayloads:
    """`TypedPayloads` of `models` (event type, class pairs), built once per models: only its
    struct, spec and version are used here, and building its validators is most of a read's
    Python time."""
    return TypedPayloads(dict(models))


@functools.cache
def _footer_pool() -> ThreadPoolExecutor:
    """The threads that fetch footers (ranged GETs, S3's latency in parallel), started once:
    starting 8 threads per read cost more than reading 16 local footers."""
    return ThreadPoolExecutor(8, thread_name_prefix="eventbus-footers")


def _segments(
    spark: Any,
    opts: SourceOptions,
    refs: Sequence[SegmentRef],
    models: tuple[tuple[str | None, type[BaseModel]], ...],
) -> Any:
    """The segments `refs` through Spark's Parquet reader, as the columns of a read of `models`
    (event type, class pairs; none: a raw read): one relation with the segments' schema given
    (no inference job), then one projection that renames three columns and turns
    ``event_time_ms`` into ``published_at`` (`_columns`)."""
    given, exprs = _columns(models)
    root = _root(opts.store)
    return parquet_select(spark, given, [f"{root}/{r.key}" for r in refs], exprs)


@functools.lru_cache(maxsize=32)
def _columns(
    models: tuple[tuple[str | None, type[BaseModel]], ...],
) -> tuple[Any, tuple[str, ...]]:
    """The segments' schema to give Spark's reader and the projection to the read's columns
    (`read_schema`), for `models` (event type, class pairs): built once per models."""
    typed = _typed_payloads(models) if models else None
    schema = read_schema(dict(models) if models else None)
    # the fixed columns are in every segment, and a typed read gets here only when all have the
    # same typed ones; the columns are given in the read's order, so that the projection is
    # plain names and renames (a cast, even to the same type, costs the analyzer)
    fields = {f.name: f for f in [pa.field("topic", pa.string()), *list(SEGMENT_SCHEMA)[1:]]}
    if typed is not None:
        fields |= {f.name: f for f in [*typed.struct, pa.field(ERROR_COLUMN, pa.string())]}
    renamed = {"published_at": "event_time_ms", "payload": "data"}
    if typed is not None:
        renamed[CORRUPT] = ERROR_COLUMN
    wanted = [
        fields[n] for n in (renamed.get(f.name, f.name) for f in schema.fields) if n in fields
    ]
    given = from_arrow_schema(pa.schema(wanted))
    have = {f.name: f.dataType for f in given.fields}
    # one SQL expression per column, sent with the paths in a fixed number of Py4J round trips
    # (`parquet_select`): a Column built per field (col, cast, alias) was three round trips each
    exprs = []
    for field in schema.fields:
        name, source = field.name, renamed.get(field.name, field.name)
        if name == "published_at":
            exprs.append(f"timestamp_millis({source}) AS {_quoted(name)}")
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
    if why not in _SAID:
        _SAID.add(why)
        log.warning("eventbus.spark.read falls back to the Python source (said once): %s", why)
    return python().load()


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
