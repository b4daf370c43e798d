"""Which segments' typed columns give a typed read's columns: matched by what the segment holds.

A typed segment (`eventbus.tier.segment`, version 2) names in its footer the event types its
typed columns were written for (``eventbus.typed_models``: ``{"<event type>" or "*":
"module:Name"}``) and holds the columns themselves, with their Parquet types. A read's models
(``model``: one model for every entry, or event type -> model) match a segment when

* **the event types are covered**: each type the read models has typed values in the segment
  (the segment's models name it), or the segment holds no entry of it (the Parquet statistics
  of ``event_type``); a read of one model for every entry needs a segment whose entries all
  have one event type its models name. A segment written with one model for every entry
  (``*``) covers a read's type when its entries all have that type, or when it names the same
  model (``module:Name``) as the read for it: a segment's ``*`` says nothing of which event
  type its model is for;
* **the columns are compatible**: a read column the segment has has the same type (Spark's type
  of both Arrow types); one it lacks (a field added in a later version of the model) is null in
  that segment's rows, as Spark's ``mergeSchema`` reads it. A column of another type is a real
  conflict: `TypedColumnConflict`, naming the column, both types and the segments.

The class names in the footer are not compared: a model renamed or moved, or the same model
named ``pkg:Model`` in one place and ``{"<type>": "pkg:Model"}`` in another, matches.

A read column whose segment values may come from entries of types the read does not model for it
(a segment written for every entry, read for one type) is **masked**: null on other types' rows,
as the Python source gives them. Segments with no typed columns, or written for other event
types, need ``data`` decoded in Python (`Match.python`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pydantic import BaseModel
from pyspark.sql.pandas.types import from_arrow_type

from eventbus.errors import ConfigError
from eventbus.tier.segment import COLUMNS
from eventbus.tier.typed import ERROR_COLUMN, model_struct

EVERY = "*"
"""A segment's (or read's) models key meaning every entry, whatever its type."""
CORRUPT_MASK = "_corrupt"
"""`Match.masked` holds it when ``typed_error`` needs the mask too."""


class TypedColumnConflict(ConfigError):
    """A typed column has another type in some segments than in the read's models."""


@dataclass(frozen=True, slots=True)
class SegmentTyping:
    """What a segment's footer says about its typed columns. `models`: the event types its typed
    columns were written for (`EVERY`: every entry) and their models' ``module:Name``, None for
    a segment without typed columns.
    `columns`: typed column -> Spark type text. `lo`/`hi`: the least and greatest ``event_type``
    of its rows (None: unknown), `nulls`: whether some rows have none (or unknown)."""

    key: str
    models: Mapping[str, str] | None  # event type or "*" -> "module:Name"
    columns: Mapping[str, str] = field(default_factory=dict)
    lo: str | None = None
    hi: str | None = None
    nulls: bool = True
    rebuilt: bool = False  # some rows' ``data`` left out (segment version 3): Python reads it

    @property
    def types(self) -> frozenset[str] | None:
        return None if self.models is None else frozenset(self.models)

    @property
    def only_type(self) -> str | None:
        """The one event type every row has, when the statistics show it."""
        return self.lo if self.lo is not None and self.lo == self.hi and not self.nulls else None

    def may_hold(self, event_type: str) -> bool:
        """Whether some row may be of `event_type` (False only when the statistics exclude it)."""
        if self.lo is None or self.hi is None:
            return True
        return self.lo <= event_type <= self.hi

    def gives_only(self, wanted: frozenset[str]) -> bool:
        """Whether the typed values this segment holds are all on rows of `wanted` types."""
        if self.types is None:
            return True
        if self.only_type is not None and self.only_type in wanted:
            return True
        return EVERY not in self.types and self.types <= wanted


def segment_typing(key: str, meta: Any) -> SegmentTyping:
    """The `SegmentTyping` of a segment from its Parquet footer `meta`
    (``pyarrow.parquet.FileMetaData``). Raises `ValueError` for a typed-models text that is not
    JSON."""
    kv = meta.metadata or {}
    spec = kv.get(b"eventbus.typed_models")
    lo, hi, nulls = _type_range(meta)
    if not spec:
        return SegmentTyping(key, None, {}, lo, hi, nulls)
    models = {str(k): str(v) for k, v in json.loads(spec.decode()).items()}  # `models_spec`
    schema = meta.schema.to_arrow_schema()
    fixed = {*COLUMNS, ERROR_COLUMN}
    columns = {f.name: spark_text(f.type) for f in schema if f.name not in fixed}
    rebuilt = int(kv.get(b"eventbus.data_rebuilt", b"0") or 0) > 0
    return SegmentTyping(key, models, columns, lo, hi, nulls, rebuilt)


def _type_range(meta: Any) -> tuple[str | None, str | None, bool]:
    names = meta.schema.names
    if "event_type" not in names:
        return None, None, True
    col = names.index("event_type")
    lo: str | None = None
    hi: str | None = None
    nulls = False
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        if group.num_rows == 0:
            continue
        st = group.column(col).statistics
        if st is None or not st.has_min_max or st.null_count is None:
            return None, None, True
        nulls = nulls or st.null_count > 0
        if st.null_count == group.num_rows:
            continue
        mn, mx = _text(st.min), _text(st.max)
        lo = mn if lo is None or mn < lo else lo
        hi = mx if hi is None or mx > hi else hi
    return lo, hi, nulls


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def spark_text(kind: pa.DataType) -> str:
    """Spark's type of Arrow type `kind`, as text (nullability and list item names aside)."""
    text: str = from_arrow_type(kind).simpleString()
    return text


@dataclass(frozen=True, slots=True)
class ReadTyping:
    """A read's models as matching needs them: the event types it models (`EVERY`: one model
    for every entry), and per typed column the types whose model has it and its Spark type."""

    keys: frozenset[str]
    fields: Mapping[str, frozenset[str]]
    kinds: Mapping[str, str]
    paths: Mapping[str, str]  # event type or `EVERY` -> its model's "module:QualName"

    @classmethod
    def of(cls, models: Mapping[str | None, type[BaseModel]]) -> ReadTyping:
        fields: dict[str, set[str]] = {}
        kinds: dict[str, str] = {}
        for key, model in models.items():
            for f in model_struct(model):
                fields.setdefault(f.name, set()).add(key or EVERY)
                kinds.setdefault(f.name, spark_text(f.type))
        keys = frozenset(k or EVERY for k in models)
        paths = {k or EVERY: f"{m.__module__}:{m.__qualname__}" for k, m in models.items()}
        return cls(keys, {k: frozenset(v) for k, v in fields.items()}, kinds, paths)


@dataclass(slots=True)
class Match:
    """How a typed read reads its segments: `native` and `python` hold indexes into the
    segments given (in their order); `why` says why the `python` ones need the Python source;
    `masked` the read columns (and `CORRUPT_MASK`) to null on rows of types the read does not
    model for them."""

    native: list[int]
    python: list[int]
    why: str | None
    masked: frozenset[str]


def match(read: ReadTyping, segments: Sequence[SegmentTyping]) -> Match:
    """Match `segments` against `read` (see the module docstring). Raises
    `TypedColumnConflict` naming each conflicting column, both types and the segments."""
    native: list[int] = []
    untyped: list[int] = []
    other: list[int] = []
    rebuilt: list[int] = []
    conflicts: dict[tuple[str, str], list[str]] = {}
    masked: set[str] = set()
    for i, seg in enumerate(segments):
        if seg.types is None:
            untyped.append(i)
            continue
        if seg.rebuilt:  # Spark's reader cannot rebuild ``data`` (`eventbus.tier.rebuild`)
            rebuilt.append(i)
            continue
        if not all(_covers(seg, key, read.paths[key]) for key in read.keys):
            other.append(i)
            continue
        for name, kind in read.kinds.items():
            have = seg.columns.get(name)
            if have is not None and have != kind:
                conflicts.setdefault((name, have), []).append(seg.key)
        native.append(i)
        if EVERY not in read.keys:
            masked |= {n for n, types in read.fields.items() if not seg.gives_only(types)}
            if not seg.gives_only(read.keys):
                masked.add(CORRUPT_MASK)
    if conflicts:
        raise TypedColumnConflict(
            "typed columns of another type in some segments than in the read's models: "
            + "; ".join(
                f"column {name!r} is {have} in {len(keys)} segment(s) ({', '.join(keys[:3])}"
                f"{', ...' if len(keys) > 3 else ''}), {read.kinds[name]} in the read's models"
                for (name, have), keys in conflicts.items()
            )
            + " (read them with a model of that type, or through the Python source, which "
            "decodes each entry's data: native=false)"
        )
    whys = []
    if untyped:
        whys.append(f"{len(untyped)} of {len(segments)} segments have no typed columns")
    if other:
        whys.append(
            f"{len(other)} of {len(segments)} segments have typed columns for other event "
            f"types than the read's models ({', '.join(sorted(read.keys))})"
        )
    if rebuilt:
        whys.append(
            f"{len(rebuilt)} of {len(segments)} segments leave out the data their typed "
            "columns rebuild (segment version 3)"
        )
    python = sorted(untyped + other + rebuilt)
    return Match(native, python, "; ".join(whys) or None, frozenset(masked))


def _covers(seg: SegmentTyping, key: str, path: str) -> bool:
    """Whether `seg`'s typed columns hold the values of read key `key`'s rows (`EVERY`: all
    rows), its model being `path`."""
    assert seg.models is not None
    if key != EVERY and key in seg.models:
        return True
    only = seg.only_type
    if EVERY in seg.models:
        same = seg.models[EVERY] == path or (only is not None and key in (EVERY, only))
        return same or (key != EVERY and not seg.may_hold(key))
    if key == EVERY:
        return only is not None and only in seg.models
    return not seg.may_hold(key)
