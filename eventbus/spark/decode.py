"""Arrow batches for Spark: verified segment reads, Redis entries, typed payload columns.

Everything here works on Arrow record batches of the segment schema (`eventbus.tier.segment.
SCHEMA`), whether the rows came from a segment or from ``XRANGE``, and turns them into batches of
the read schema (`eventbus.spark.schema`) with vectorised casts; only payload decoding (with a
model) touches rows one by one.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import io
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, TypeAdapter, ValidationError

from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE, FORMAT_MSGPACK, decode_entry
from eventbus.errors import DecodeError
from eventbus.spark.schema import BASE_NAMES, CORRUPT
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.ids import EntryId
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment import SCHEMA, read_info

BATCH_ROWS = 32768


def read_segment(
    data: bytes, ref: SegmentRef, batch_rows: int = BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Verify segment `data` (key `ref.key`) and yield its rows as segment-schema batches.

    The checks of `eventbus.tier.segment.decode_segment`, vectorised: Parquet structure and page
    checksums, schema, metadata matching the key, row count, no nulls in required columns, entry
    IDs strictly increasing within the key's range. Raises `CorruptSegment` naming the key.
    """
    key = ref.key
    try:
        pf = pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True)
        info = read_info(pf.schema_arrow, key)
        if pa.schema(list(pf.schema_arrow)) != pa.schema(list(SCHEMA)):
            raise CorruptSegment(key, f"unexpected schema {pf.schema_arrow}")
        if (info.topic, info.shard, info.first, info.last) != (
            ref.topic,
            ref.shard,
            ref.first,
            ref.last,
        ):
            raise CorruptSegment(
                key,
                f"metadata says {info.topic}/{info.shard} "
                f"{info.first}..{info.last}, not what the key says",
            )
        table = pf.read()
    except CorruptSegment:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on damaged files
        raise CorruptSegment(key, f"{type(exc).__name__}: {exc}") from None
    if table.num_rows != info.entries:
        raise CorruptSegment(key, f"{table.num_rows} rows, metadata says {info.entries}")
    for field in SCHEMA:
        if not field.nullable and table.column(field.name).null_count:
            raise CorruptSegment(key, f"column {field.name} has nulls")
    _check_order(table, info.first, info.last, key)
    yield from table.to_batches(max_chunksize=batch_rows)


def _check_order(table: pa.Table, first: EntryId, last: EntryId, key: str) -> None:
    if table.num_rows == 0:
        return
    ms = table.column("entry_ms").combine_chunks()
    seq = table.column("entry_seq").combine_chunks()
    lo = (ms[0].as_py(), seq[0].as_py())
    hi = (ms[-1].as_py(), seq[-1].as_py())
    ok = tuple(first) <= lo and hi <= tuple(last)
    if ok and table.num_rows > 1:
        a_ms, b_ms = ms.slice(0, len(ms) - 1), ms.slice(1)
        a_seq, b_seq = seq.slice(0, len(seq) - 1), seq.slice(1)
        increasing = pc.or_(
            pc.greater(b_ms, a_ms), pc.and_(pc.equal(b_ms, a_ms), pc.greater(b_seq, a_seq))
        )
        ok = pc.all(increasing).as_py()
    if not ok:
        raise CorruptSegment(key, f"entries out of order or outside {first}..{last}")


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def entries_batch(
    topic: str, shard: int, entries: Sequence[tuple[EntryId, Mapping[bytes, bytes]]]
) -> pa.RecordBatch:
    """Redis entries (ID, field map) as one segment-schema batch (as the offloader would store
    them: envelope columns null when the envelope does not decode)."""
    cols: dict[str, list[Any]] = {n: [] for n in SCHEMA.names}
    for entry_id, fields in entries:
        cols["entry_id"].append(str(entry_id))
        cols["entry_ms"].append(entry_id.ms)
        cols["entry_seq"].append(entry_id.seq)
        cols["resource_id"].append(_text(fields.get(F_RESOURCE)))
        cols["event_type"].append(_text(fields.get(F_TYPE)))
        cols["data"].append(fields.get(F_DATA, b""))
        try:
            env = decode_entry(dict(fields))
        except DecodeError:
            cols["event_time_ms"].append(None)
            cols["event_id"].append(None)
            cols["headers"].append(None)
        else:
            h = env.event_id.hex()
            cols["event_time_ms"].append(env.time_ms)
            cols["event_id"].append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
            cols["headers"].append(list(env.headers.items()))
    n = len(entries)
    cols["topic"] = [topic] * n
    cols["shard"] = [shard] * n
    arrays = [pa.array(cols[f.name], f.type if f.name != "topic" else pa.string()) for f in SCHEMA]
    arrays[0] = arrays[0].dictionary_encode()
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def id_mask(batch: pa.RecordBatch, after: EntryId | None, upto: EntryId | None) -> Any:
    """Boolean mask of rows with `after` < entry ID <= `upto` (either bound may be None)."""
    ms, seq = batch.column("entry_ms"), batch.column("entry_seq")
    mask = None
    if after is not None:
        m = pc.or_(
            pc.greater(ms, after.ms), pc.and_(pc.equal(ms, after.ms), pc.greater(seq, after.seq))
        )
        mask = m
    if upto is not None:
        m = pc.or_(
            pc.less(ms, upto.ms), pc.and_(pc.equal(ms, upto.ms), pc.less_equal(seq, upto.seq))
        )
        mask = m if mask is None else pc.and_(mask, m)
    return mask


class Converter:
    """Turns segment-schema batches into read-schema batches (`target`, Spark's Arrow schema).

    `models`: None (raw read) or event type -> model (key None: every entry). `mode`:
    ``PERMISSIVE`` (undecodable payload -> ``_corrupt``) or ``FAILFAST`` (raise `DecodeError`).
    `validate`: validate with pydantic (default); False converts the payload maps straight to
    Arrow (faster; validators and constraints do not run; a batch that does not convert falls
    back to pydantic).
    """

    def __init__(
        self,
        target: pa.Schema,
        models: Mapping[str | None, type[BaseModel]] | None,
        mode: str = "PERMISSIVE",
        validate: bool = True,
    ) -> None:
        self.target = target
        self.models = dict(models or {})
        self.failfast = mode == "FAILFAST"
        self.validate = validate
        self.typed_names = [n for n in target.names if n not in BASE_NAMES and n != CORRUPT]
        self.typed_type = pa.struct([target.field(n) for n in self.typed_names])
        self.adapters = {k: TypeAdapter(list[m]) for k, m in self.models.items()}

    def convert(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """One read-schema batch for one segment-schema batch (same rows, same order)."""
        n = batch.num_rows
        published = batch.column("event_time_ms")
        published = pc.multiply(published, pa.scalar(1000, pa.int64())).cast(
            pa.timestamp("us", tz="UTC")
        )
        topic = batch.column("topic")
        if pa.types.is_dictionary(topic.type):
            topic = topic.dictionary_decode()
        base = {
            "topic": topic,
            "shard": batch.column("shard"),
            "entry_id": batch.column("entry_id"),
            "entry_ms": batch.column("entry_ms"),
            "entry_seq": batch.column("entry_seq"),
            "resource_id": batch.column("resource_id"),
            "event_type": batch.column("event_type"),
            "event_id": batch.column("event_id"),
            "published_at": published,
            "headers": batch.column("headers"),
            "payload": batch.column("data"),
        }
        corrupt: list[str | None] | None = None
        typed: dict[str, Any] = {}
        if self.models:
            typed, corrupt = self._typed(batch)
        arrays = []
        for field in self.target:
            if field.name in base:
                arrays.append(base[field.name].cast(field.type))
            elif field.name == CORRUPT:
                arrays.append(pa.array(corrupt if corrupt else [None] * n, pa.string()))
            else:
                arrays.append(typed[field.name].cast(field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.target)

    def _typed(self, batch: pa.RecordBatch) -> tuple[dict[str, Any], list[str | None] | None]:
        data = batch.column("data").to_pylist()
        types = batch.column("event_type").to_pylist()
        ids = batch.column("entry_id").to_pylist()
        n = len(data)
        corrupt: list[str | None] = [None] * n
        rows: list[dict[str, Any] | None] = [None] * n
        groups: dict[str | None, list[int]] = {}
        payloads: list[Any] = [None] * n
        for i, (raw, etype) in enumerate(zip(data, types, strict=True)):
            key: str | None = None if None in self.models else etype
            if key not in self.models:
                continue
            try:
                payloads[i] = _payload(raw)
            except DecodeError as exc:
                corrupt[i] = f"DecodeError: {exc}"
                continue
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            self._decode_group(key, idx, payloads, rows, corrupt)
        if self.failfast:
            for i, why in enumerate(corrupt):
                if why is not None:
                    raise DecodeError(f"entry {ids[i]} of shard {batch.column('shard')[i]}: {why}")
        struct = pa.array(rows, self.typed_type)
        cols = dict(zip(self.typed_names, struct.flatten(), strict=True))
        return cols, corrupt if any(c is not None for c in corrupt) else None

    def _decode_group(
        self,
        key: str | None,
        idx: list[int],
        payloads: list[Any],
        rows: list[dict[str, Any] | None],
        corrupt: list[str | None],
    ) -> None:
        values = [payloads[i] for i in idx]
        if not self.validate:
            try:
                pa.array(values, self.typed_type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
                pass
            else:
                for i, v in zip(idx, values, strict=True):
                    rows[i] = v
                return
        adapter = self.adapters[key]
        try:
            models = adapter.validate_python(values)
        except ValidationError:
            model = self.models[key]
            for i in idx:
                try:
                    rows[i] = _row(model.model_validate(payloads[i]))
                except ValidationError as exc:
                    corrupt[i] = f"ValidationError: {model.__name__}: {_short(exc)}"
            return
        for i, m in zip(idx, models, strict=True):
            rows[i] = _row(m)


def _payload(raw: bytes) -> Any:
    """The payload (``p``) of an envelope; msgpack-only envelopes without the `Envelope` object
    (the common case), others through `decode_entry`. Raises `DecodeError`."""
    if raw and raw[0] == FORMAT_MSGPACK:
        try:
            env = msgpack.unpackb(raw[1:], raw=False, strict_map_key=True)
            return env["p"]
        except Exception as exc:
            raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None
    return decode_entry({F_RESOURCE: b"-", F_TYPE: b"-", F_DATA: raw}).payload


def _row(model: BaseModel) -> dict[str, Any]:
    """A validated model as a dict Arrow converts: plain fields as they are; nested models as
    dicts, enums as their values, UUIDs and decimals as text."""
    d = model.__dict__
    if all(type(v) in _PLAIN for v in d.values()):
        return d
    return {k: _plain(v) for k, v in d.items()}


def _plain(value: Any) -> Any:
    if type(value) in _PLAIN or isinstance(value, dt.date):
        return value
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, v in value.__dict__.items()}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    return json.dumps(value, default=str)


_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
