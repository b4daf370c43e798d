"""`ArchivedEntry`, what replay yields: one archived stream entry whose fields come from its
batch's columns, each column made Python values the first time an entry of the batch asks
for that field, for the whole batch at once (`rows_entries`). Re-exported by
`eventbus.tier.archived` and `eventbus.tier.replay`."""

from __future__ import annotations

import contextlib
import gc
import threading
import uuid
from collections.abc import Iterator
from itertools import repeat
from operator import attrgetter, getitem
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry
from eventbus.protocol.ids import EntryId
from eventbus.tier.errors import CorruptSegment

FIELDS = (
    "topic",
    "shard",
    "entry_id",
    "resource_id",
    "event_type",
    "published_at_ms",
    "event_id",
    "headers",
    "data",
    "segment",
)
"""`ArchivedEntry`'s fields, in the order of its constructor's parameters."""


class _Rows:
    """Consecutive rows of one segment (`table`, segment columns) and what names them; each
    column a list of Python values once an entry asked for it (None before)."""

    __slots__ = (
        *("datas", "headers", "ids", "kinds", "rids", "segment", "shard", "table"),
        *("times", "topic", "uuids"),
    )

    def __init__(self, table: pa.Table | None, topic: str, shard: int, segment: str) -> None:
        self.table, self.topic, self.shard, self.segment = table, topic, shard, segment
        self.ids: list[EntryId] | None = None
        self.rids: list[str | None] | None = None
        self.kinds: list[str | None] | None = None
        self.times: list[int | None] | None = None
        self.uuids: list[uuid.UUID | None] | None = None
        self.headers: list[dict[str, str] | None] | None = None
        self.datas: list[bytes] | None = None

    def column(self, name: str) -> Any:
        assert self.table is not None  # (a row made by the constructor has every list)
        return self.table.column(name)

    def make_ids(self) -> list[EntryId]:
        with paused_gc():
            ids = _ids(self.column("entry_ms").to_pylist(), self.column("entry_seq").to_pylist())
        self.ids = ids
        return ids

    def make_rids(self) -> list[str | None]:
        rids: list[str | None] = self.column("resource_id").to_pylist()
        self.rids = rids
        return rids

    def make_kinds(self) -> list[str | None]:
        kinds: list[str | None] = self.column("event_type").to_pylist()
        self.kinds = kinds
        return kinds

    def make_times(self) -> list[int | None]:
        times: list[int | None] = self.column("event_time_ms").to_pylist()
        self.times = times
        return times

    def make_uuids(self) -> list[uuid.UUID | None]:
        with paused_gc():
            uuids = _uuids(self.column("event_id"), self.segment)
        self.uuids = uuids
        return uuids

    def make_headers(self) -> list[dict[str, str] | None]:
        self.headers = headers = _headers(self.column("headers").combine_chunks())
        return headers

    def make_datas(self) -> list[bytes]:
        datas: list[bytes] = self.column("data").to_pylist()
        self.datas = datas
        return datas


class ArchivedEntry:
    """One archived stream entry. `segment` is the key of the object it came from.

    Times are Unix milliseconds: `entry_id.ms` is Redis's clock when the entry was added,
    `published_at_ms` the publisher's (the segment column ``event_time_ms``). `event_id` is the
    event's UUID, as `Context.event_id`. Envelope-derived fields are None when the entry's
    envelope did not decode when it was archived.

    Immutable, compared (``==``) and hashed field by field, pickled by its fields. An entry
    replay made reads each field from its batch's columns, made Python values for the whole
    batch the first time any entry of it asks for that field (replay makes entries by the
    thousand: building every field of every entry up front took most of a raw replay); so an
    entry kept holds its batch's rows (at most `eventbus.tier.replay.BATCH_ROWS`) in memory.
    """

    __slots__ = ("_i", "_r")
    __match_args__ = (
        *("topic", "shard", "entry_id", "resource_id", "event_type", "published_at_ms"),
        *("event_id", "headers", "data", "segment"),
    )

    _r: _Rows
    _i: int

    def __init__(
        self,
        topic: str,
        shard: int,
        entry_id: EntryId,
        resource_id: str | None,
        event_type: str | None,
        published_at_ms: int | None,
        event_id: uuid.UUID | None,
        headers: dict[str, str] | None,
        data: bytes,
        segment: str,
    ) -> None:
        r = _Rows(None, topic, shard, segment)
        r.ids, r.rids, r.kinds, r.times = [entry_id], [resource_id], [event_type], [published_at_ms]
        r.uuids, r.headers, r.datas = [event_id], [headers], [data]
        object.__setattr__(self, "_r", r)
        object.__setattr__(self, "_i", 0)

    @property
    def topic(self) -> str:
        return self._r.topic

    @property
    def shard(self) -> int:
        return self._r.shard

    @property
    def segment(self) -> str:
        return self._r.segment

    @property
    def entry_id(self) -> EntryId:
        r = self._r
        return (r.ids or r.make_ids())[self._i]

    @property
    def resource_id(self) -> str | None:
        r = self._r
        return (r.rids or r.make_rids())[self._i]

    @property
    def event_type(self) -> str | None:
        r = self._r
        return (r.kinds or r.make_kinds())[self._i]

    @property
    def published_at_ms(self) -> int | None:
        r = self._r
        return (r.times or r.make_times())[self._i]

    @property
    def event_id(self) -> uuid.UUID | None:
        r = self._r
        return (r.uuids or r.make_uuids())[self._i]

    @property
    def headers(self) -> dict[str, str] | None:
        r = self._r
        return (r.headers or r.make_headers())[self._i]

    @property
    def data(self) -> bytes:
        r = self._r
        return (r.datas or r.make_datas())[self._i]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ArchivedEntry is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ArchivedEntry is immutable: cannot delete {name!r}")

    def values(self) -> tuple[Any, ...]:
        """The fields' values, in `FIELDS` order."""
        return tuple(getattr(self, name) for name in FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArchivedEntry):
            return NotImplemented
        return self is other or self.values() == other.values()

    def __hash__(self) -> int:
        return hash(self.values())  # (TypeError with headers, a dict, as before)

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(FIELDS, self.values(), strict=True))
        return f"ArchivedEntry({shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        return ArchivedEntry, self.values()

    def fields(self) -> dict[bytes, bytes]:
        """The entry's field map as it was in the stream (``rid``, ``type``, ``data``)."""
        out = {F_DATA: self.data}
        resource_id, event_type = self.resource_id, self.event_type
        if resource_id is not None:
            out[F_RESOURCE] = resource_id.encode()
        if event_type is not None:
            out[F_TYPE] = event_type.encode()
        return out

    def envelope(self) -> Envelope:
        """The decoded envelope. Raises `DecodeError` naming the segment and entry."""
        try:
            return decode_entry(self.fields())
        except DecodeError as exc:
            raise DecodeError(f"{self.segment} entry {self.entry_id}: {exc}") from None


_NEW = object.__new__
_SET = object.__setattr__


def rows_entries(table: pa.Table, topic: str, shard: int, key: str) -> list[ArchivedEntry]:
    """The rows of `table` (segment columns, of segment `key`) as `ArchivedEntry`s reading
    their fields from it. Raises `CorruptSegment` for an ``event_id`` that is not a UUID (now,
    not when the field is first read)."""
    n = table.num_rows
    if n == 0:
        return []
    check_event_ids(table.column("event_id"), key)
    rows = _Rows(table, topic, shard, key)
    out = []
    with paused_gc():
        for i in range(n):
            e = _NEW(ArchivedEntry)
            _SET(e, "_r", rows)
            _SET(e, "_i", i)
            out.append(e)
    return out


UUID_TEXT = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
"""A UUID's usual spelling (a column is checked against it in Arrow; a value that does not
match is checked as `uuid.UUID` converts it)."""


def check_event_ids(column: Any, key: str) -> None:
    """Raise `CorruptSegment` (segment `key`) unless every value of the ``event_id`` column
    `column` is null or a UUID (in Arrow for the usual spelling, `uuid.UUID`'s rules for the
    others)."""
    if not pc.all(pc.match_substring_regex(column, UUID_TEXT)).as_py():
        _uuids(column, key)


_gc_lock = threading.Lock()
_gc_pausers = 0  # threads making entries with the cyclic garbage collector paused
_gc_paused_by_us = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) while entries are made: a batch
    allocates a few tracked objects per row (UUIDs, ID tuples, column lists), whose
    collections took 40-45 % of a raw replay (flights, measured with ``gc.callbacks``); the
    objects form no cycles, reference counting frees them. Resumed when the last concurrent
    pauser ends, unless the application had disabled the collector itself (the pattern of
    `eventbus.consumer.decoding`'s large-entry decode, which tier code cannot import)."""
    global _gc_pausers, _gc_paused_by_us
    with _gc_lock:
        if _gc_pausers == 0 and gc.isenabled():
            gc.disable()
            _gc_paused_by_us = True
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_paused_by_us:
                _gc_paused_by_us = False
                gc.enable()


_NEW_ID = tuple.__new__  # EntryId(ms, seq) without its Python-level __new__: in C, via map


def _ids(ms: list[int], seq: list[int]) -> list[EntryId]:
    return list(map(_NEW_ID, repeat(EntryId), zip(ms, seq, strict=True)))


def _uuids(column: Any, key: str) -> list[uuid.UUID | None]:
    """The ``event_id`` column (UUID text, null where the envelope did not decode) as UUIDs:
    converted in one call (msgspec, in C), entry by entry only for nulls or odd spellings.
    Raises `CorruptSegment` for a value that is not a UUID."""
    texts = column.to_pylist()
    if not column.null_count:
        try:
            return msgspec.convert(texts, list[uuid.UUID])  # type: ignore[no-any-return]
        except msgspec.ValidationError:
            pass  # a spelling msgspec refuses (braces, urn:): uuid.UUID's rules, below
    try:
        return [None if t is None else uuid.UUID(t) for t in texts]
    except ValueError as exc:
        raise CorruptSegment(
            key, f"column event_id holds a value that is not a UUID: {exc}"
        ) from None


def _headers(maps: pa.MapArray) -> list[dict[str, str] | None]:
    """The ``headers`` column as dicts (None where null); without a Python list per row when
    no row has a header (the common case)."""
    offsets = maps.offsets
    if not maps.null_count and offsets[0].as_py() == offsets[len(maps)].as_py():
        return list(map(dict, repeat((), len(maps))))
    return [None if m is None else dict(m) for m in maps.to_pylist()]


def all_have_event_ids(entries: list[ArchivedEntry]) -> bool:
    """Whether every one of `entries` has an `event_id` (its envelope decoded when it was
    archived), told from each batch's column's null count, without making the UUIDs."""
    rows = {id(r): r for r in [e._r for e in entries]}.values()
    if all(r.table is not None and not r.column("event_id").null_count for r in rows):
        return True
    return None not in [e.event_id for e in entries]


_ROWS_OF = attrgetter("_r")
_ROW_OF = attrgetter("_i")
_ENVELOPE_COLUMNS = ("datas", "times", "rids", "kinds")


def envelope_columns(entries: list[ArchivedEntry]) -> tuple[list[Any], ...]:
    """The ``data``, ``published_at_ms``, ``resource_id`` and ``event_type`` of each of
    `entries`, as four lists read from their batches' columns in bulk (typed replay's batch
    decode: no attribute lookup per entry and field)."""
    rows = list(map(_ROWS_OF, entries))
    for r in {id(r): r for r in rows}.values():
        _ = r.datas or r.make_datas(), r.times or r.make_times()
        _ = r.rids or r.make_rids(), r.kinds or r.make_kinds()
    at = list(map(_ROW_OF, entries))
    return tuple(list(map(getitem, map(attrgetter(c), rows), at)) for c in _ENVELOPE_COLUMNS)
