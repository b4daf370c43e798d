"""Reading segments (the format: `eventbus.tier.segment`): `decode_segment`, the one reader,
parses and verifies a whole file; `decode_segment_batches` does the same by record batches
(replay, `eventbus.tier.archived`). Both raise `CorruptSegment` naming the key, never return
wrong data; a version-3 segment's left-out ``data`` is rebuilt (`eventbus.tier.rebuild`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.protocol.ids import EntryId
from eventbus.tier import rebuild
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.segment import (
    COLUMNS,
    FORMAT_VERSION,
    REBUILT_SCHEMA,
    REBUILT_VERSION,
    SCHEMA,
    TYPED_VERSION,
    SegmentInfo,
    _after_previous,
)
from eventbus.tier.typed import ERROR_COLUMN


def _meta(schema: Any, name: str, key: str) -> str:
    raw = (schema.metadata or {}).get(f"eventbus.{name}".encode())
    if raw is None:
        raise CorruptSegment(key, f"metadata lacks eventbus.{name}")
    return bytes(raw).decode()


def read_info(schema: Any, key: str) -> SegmentInfo:
    """The `SegmentInfo` in an Arrow schema's metadata. Raises `CorruptSegment`."""
    from eventbus.protocol.ids import parse_id

    try:
        version = _meta(schema, "segment_version", key)
        if version not in (FORMAT_VERSION, TYPED_VERSION, REBUILT_VERSION):
            raise CorruptSegment(key, f"unsupported segment version {version!r}")
        typed = version in (TYPED_VERSION, REBUILT_VERSION)
        rebuilt = version == REBUILT_VERSION
        data_fields = _meta(schema, "data_fields", key) if rebuilt else None
        if data_fields is not None:
            rebuild.parse_fields(data_fields)
        return SegmentInfo(
            topic=_meta(schema, "topic", key),
            shard=int(_meta(schema, "shard", key)),
            first=parse_id(_meta(schema, "first", key)),
            last=parse_id(_meta(schema, "last", key)),
            entries=int(_meta(schema, "entries", key)),
            raw_bytes=int(_meta(schema, "raw_bytes", key)),
            typed_models=_meta(schema, "typed_models", key) if typed else None,
            typed_version=_meta(schema, "typed_version", key) if typed else None,
            typed_invalid=int(_meta(schema, "typed_invalid", key)) if typed else 0,
            data_fields=data_fields,
            data_rebuilt=int(_meta(schema, "data_rebuilt", key)) if rebuilt else 0,
        )
    except CorruptSegment:
        raise
    except Exception as exc:  # int() / parse_id on garbage metadata
        raise CorruptSegment(key, f"bad metadata: {exc}") from None


def check_schema(schema: pa.Schema, info: SegmentInfo, key: str) -> None:
    """Raise `CorruptSegment` unless `schema` starts with `SCHEMA`'s columns and has more only
    in a typed segment (ending with ``typed_error``)."""
    fields = list(schema)
    extra = fields[len(SCHEMA) :]
    base = SCHEMA if info.data_fields is None else REBUILT_SCHEMA
    ok = pa.schema(fields[: len(SCHEMA)]) == pa.schema(list(base))
    if info.typed_version is None:
        ok = ok and not extra
    else:
        ok = ok and bool(extra) and extra[-1] == pa.field(ERROR_COLUMN, pa.string())
    if not ok:
        raise CorruptSegment(key, f"unexpected schema {schema}")


def _check_expected(
    info: SegmentInfo, key: str, expect: tuple[str, int, EntryId, EntryId] | None
) -> None:
    """Raise `CorruptSegment` when the metadata's topic, shard and range are not `expect`
    (what the object key names)."""
    if expect is not None and (info.topic, info.shard, info.first, info.last) != expect:
        raise CorruptSegment(
            key,
            f"metadata says {info.topic}/{info.shard} {info.first}..{info.last}, "
            f"the key says {expect[0]}/{expect[1]} {expect[2]}..{expect[3]}",
        )


def decode_segment(
    data: bytes,
    key: str,
    *,
    expect: tuple[str, int, EntryId, EntryId] | None = None,
    columns: Sequence[str] | None = None,
) -> tuple[pa.Table, SegmentInfo]:
    """Parse and verify a segment file; `key` names it in errors. The one segment reader, with
    `decode_segment_batches` (the same checks, by record batches: replay, `eventbus.tier.
    archived`): the offloader adopting an object, catch-up and the Spark source
    (`eventbus.spark.reading`) read segments through it.

    Checks the Parquet structure and page checksums, the schema, the metadata (and that it
    matches `expect` = (topic, shard, first, last) when given, e.g. `SegmentRef.span` from the
    key), the row count, that no required column has nulls, and that entry IDs strictly increase
    within the range (on whole columns). Returns the table (the segment-schema columns, only
    `columns` if given; the ID columns are always read; typed payload columns never returned,
    but read to rebuild a version-3 segment's ``data``) and its info. Raises `CorruptSegment`
    naming `key` when any check fails (a left-out ``data`` that cannot be rebuilt too): never
    returns wrong data.
    """
    try:
        # parsed from a copy Arrow owns, not from `data`: Arrow's worker threads release the
        # buffers they read after `read` returns, and a Python-owned one needs the GIL for that,
        # which a thread cannot take while the interpreter exits (std::terminate: exit -6 of a
        # CLI that failed on a corrupt segment)
        owned = pa.allocate_buffer(len(data))
        memoryview(owned).cast("B")[:] = data
        pf = pq.ParquetFile(pa.BufferReader(owned), page_checksum_verification=True)
        schema = pf.schema_arrow
        info = read_info(schema, key)
        check_schema(schema, info, key)
        wanted = (
            list(COLUMNS)
            if columns is None
            else list(dict.fromkeys(["entry_ms", "entry_seq", *columns]))
        )
        needs = _rebuild_columns(info) if "data" in wanted else []
        table = pf.read(columns=list(dict.fromkeys([*wanted, *needs])))
        if needs:
            table = _restored(table, info, wanted)
    except CorruptSegment:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on damaged files
        raise CorruptSegment(key, f"{type(exc).__name__}: {exc}") from None
    _check_expected(info, key, expect)
    if table.num_rows != info.entries:
        raise CorruptSegment(key, f"{table.num_rows} rows, metadata says {info.entries}")
    for name in table.column_names:
        if not SCHEMA.field(name).nullable and table.column(name).null_count:
            raise CorruptSegment(key, f"column {name} has nulls")
    _check_order(table, info, key)
    return table, info


def decode_segment_batches(
    data: bytes,
    key: str,
    *,
    expect: tuple[str, int, EntryId, EntryId] | None = None,
    batch_rows: int,
    extra: Callable[[SegmentInfo, pa.Schema], Sequence[str]] | None = None,
) -> tuple[SegmentInfo, Iterator[pa.Table]]:
    """`decode_segment` by record batches of at most `batch_rows` rows (the segment-schema
    columns), so that a reader works on the first rows while the next are decoded. The
    Parquet structure, schema, metadata (and `expect`) and the footer's row count are checked
    before this returns; each batch, as it is read, for its page checksums, nulls, entry order
    (after the batch before) and range, its left-out ``data`` rebuilt; the rows read and
    ``data`` left out are compared with the metadata after the last. Raises `CorruptSegment`
    naming `key`: from here for the file's checks, from the iterator at the batch that fails
    (the batches before it held right rows). `extra(info, schema)` names more columns of the
    file (typed columns: `eventbus.tier.replay_columns`) each batch holds after the
    segment-schema ones (none when not given), and then `REBUILT_ROWS` where ``data`` is
    rebuilt."""
    try:
        owned = pa.allocate_buffer(len(data))  # (why a copy: `decode_segment`)
        memoryview(owned).cast("B")[:] = data
        pf = pq.ParquetFile(pa.BufferReader(owned), page_checksum_verification=True)
        schema = pf.schema_arrow
        info = read_info(schema, key)
        check_schema(schema, info, key)
        rows = pf.metadata.num_rows
    except CorruptSegment:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on damaged files
        raise CorruptSegment(key, f"{type(exc).__name__}: {exc}") from None
    _check_expected(info, key, expect)
    if rows != info.entries:
        raise CorruptSegment(key, f"{rows} rows, metadata says {info.entries}")
    more = [] if extra is None else [c for c in extra(info, schema) if c not in COLUMNS]
    return info, _batches(pf, info, key, batch_rows, more)


REBUILT_ROWS = "_data_rebuilt"
"""A batch column of `decode_segment_batches` asked for `extra` columns of a version-3 segment
with left-out ``data``: true where that row's ``data`` was rebuilt from its typed columns."""


def _batches(
    pf: Any, info: SegmentInfo, key: str, batch_rows: int, more: Sequence[str] = ()
) -> Iterator[pa.Table]:
    """`decode_segment_batches`'s batches (the segment-schema columns, then `more`)."""
    wanted = [*COLUMNS, *more]
    needs = _rebuild_columns(info)
    reader = pf.iter_batches(batch_size=batch_rows, columns=list(dict.fromkeys([*wanted, *needs])))
    last: EntryId | None = None
    rows = left_out = 0
    while True:
        try:
            batch = next(reader, None)
            if batch is None:
                break
            table = pa.Table.from_batches([batch])
            if needs:
                left_out += table.column("data").null_count
                rebuilt = pc.is_null(table.column("data"))
                table = _restored(table, info, wanted, whole=False)
                if more:  # which rows' ``data`` the columns rebuilt (`REBUILT_ROWS`)
                    table = table.append_column(REBUILT_ROWS, rebuilt)
        except Exception as exc:  # as `decode_segment`'s
            raise CorruptSegment(key, f"{type(exc).__name__}: {exc}") from None
        for name in COLUMNS:
            if not SCHEMA.field(name).nullable and table.column(name).null_count:
                raise CorruptSegment(key, f"column {name} has nulls")
        _check_order(table, info, key, last)
        n = table.num_rows
        if n:
            rows += n
            ms, seq = table.column("entry_ms"), table.column("entry_seq")
            last = EntryId(ms[n - 1].as_py(), seq[n - 1].as_py())
            yield table
    if rows != info.entries:
        raise CorruptSegment(key, f"{rows} rows read, metadata says {info.entries}")
    if needs and left_out != info.data_rebuilt:
        raise CorruptSegment(
            key, f"{left_out} entries without data, metadata says {info.data_rebuilt}"
        )


_ENVELOPE = ("event_type", "event_id", "event_time_ms", "headers", ERROR_COLUMN)


def _rebuild_columns(info: SegmentInfo) -> list[str]:
    """The columns `_restored` reads to rebuild a version-3 segment's ``data`` (none when no
    entry's ``data`` was left out)."""
    if info.data_fields is None or not info.data_rebuilt:
        return []
    fields = rebuild.parse_fields(info.data_fields)
    return list(dict.fromkeys([*_ENVELOPE, *(n for names in fields.values() for n in names)]))


def _restored(
    table: pa.Table, info: SegmentInfo, wanted: list[str], *, whole: bool = True
) -> pa.Table:
    """`table` with its ``data`` column rebuilt where null (`eventbus.tier.rebuild.restore`),
    cut to the `wanted` columns. Raises `ValueError` when a null cannot be rebuilt, or (for the
    `whole` segment) when the nulls are not as many as the metadata says."""
    assert info.data_fields is not None
    fields = rebuild.parse_fields(info.data_fields)
    columns = {name: table.column(name) for name in table.column_names}
    if whole and columns["data"].null_count != info.data_rebuilt:
        raise ValueError(
            f"{columns['data'].null_count} entries without data, metadata says {info.data_rebuilt}"
        )
    data = rebuild.restore(
        fields, columns["data"], columns["event_type"], columns[ERROR_COLUMN], columns
    )
    table = table.set_column(table.column_names.index("data"), SCHEMA.field("data"), data)
    return table.select(wanted)


def _check_order(
    table: pa.Table, info: SegmentInfo, key: str, previous: EntryId | None = None
) -> None:
    """Raise `CorruptSegment` naming the first entry that is not after the one before it (the
    first row: not after `previous`, the last row of the batch before, when given) or lies outside
    ``info.first..info.last``. The order is checked on whole columns; the range on the first
    and last rows, and on a fault by bisecting the ordered prefix (never row by row)."""
    n = table.num_rows
    if n == 0:
        return
    ms = table.column("entry_ms").combine_chunks()
    seq = table.column("entry_seq").combine_chunks()

    def entry(i: int) -> EntryId:
        return EntryId(ms[i].as_py(), seq[i].as_py())

    disorder = n  # the first row not after the row before it
    if n > 1:
        after = _after_previous(ms, seq)
        if not pc.all(after).as_py():  # where: only on a fault (`index` is the slower scan)
            disorder = pc.index(after, False).as_py() + 1
    bad = 0 if entry(0) < info.first or (previous is not None and entry(0) <= previous) else None
    if bad is None and (disorder < n or entry(n - 1) > info.last):
        # rows before `disorder` increase: the first one past `last`, else `disorder`
        beyond = bisect.bisect_right(range(disorder), info.last, key=entry)
        bad = beyond if beyond < n else None
    if bad is not None:
        raise CorruptSegment(
            key, f"entry {entry(bad)} out of order or outside {info.first}..{info.last}"
        )
