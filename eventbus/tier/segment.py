"""The segment format: one immutable Parquet file (zstd) per run of a shard's entries.

One row per stream entry, in entry-ID order. Columns (docs/tier.md is the spec):

=============== ====================== =========================================================
column          Arrow type             meaning
=============== ====================== =========================================================
topic           string (dictionary)    topic name
shard           int32                  shard index
entry_id        string                 Redis entry ID ``<ms>-<seq>``
entry_ms        int64                  its millisecond part (Redis time the entry was added)
entry_seq       int64                  its sequence part
resource_id     string, nullable       the entry's ``rid`` field
event_type      string, nullable       the entry's ``type`` field
event_time_ms   int64, nullable        envelope time (publisher clock, Unix ms)
event_id        string, nullable       envelope event ID as a UUID text
headers         map<string, string>,   envelope headers
                nullable
data            binary                 the entry's raw ``data`` field (envelope bytes; decode
                                       with `eventbus.protocol.codec.decode_entry`)
=============== ====================== =========================================================

Envelope-derived columns are null when the entry's envelope does not decode; the raw ``data``
bytes are kept regardless. A *typed* segment (the topic has registered models:
`eventbus.tier.typed`) has more columns after ``data``: one per model field (the payload as
typed values, null where the entry's type has no model or its payload does not validate), then
``typed_error`` (string: why a modelled entry's typed columns are null). A version-3 segment
(``rebuild_data``) leaves ``data`` null where those columns rebuild its bytes exactly
(`eventbus.tier.rebuild`, checked per entry when written); `decode_segment` rebuilds it, so
every reader sees the complete column. The file's key-value metadata holds
``eventbus.segment_version`` (``1``; ``2`` for a typed segment, ``3`` for one with rebuilt
data; both also have ``eventbus.typed_models``, the models as ``{"<event type>":
"module:Name"}``, ``eventbus.typed_version``, a fingerprint of the models and their columns'
types, and ``eventbus.typed_invalid``, the entries whose payload did not validate; version 3
``eventbus.data_fields`` and ``eventbus.data_rebuilt``), ``eventbus.topic``,
``eventbus.shard``, ``eventbus.first``, ``eventbus.last`` (the range the key names),
``eventbus.entries`` and ``eventbus.raw_bytes`` (field names + values of the entries, as counted
against ``max_payload_bytes``). Data pages carry CRC32 checksums, verified on read.

Writing: `eventbus.tier.segment_columns.entry_columns` builds the columns of a run of entries
at once (from XRANGE's raw replies: no object per entry beyond the decoded envelope,
`eventbus.tier.segment_bodies`), `eventbus.tier.segment_write.encode_columns` checks their order
and writes the file with per-column encodings (`_ENCODINGS`; transparent to every reader).
Reading: `decode_segment`, the one reader, verifies a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from eventbus.protocol.ids import EntryId
from eventbus.tier.segment_columns import entry_columns

FORMAT_VERSION = "1"
TYPED_VERSION = "2"
REBUILT_VERSION = "3"
"""A typed segment whose ``data`` is null where its other columns rebuild it exactly
(`eventbus.tier.rebuild`); its metadata adds ``eventbus.data_fields``."""

SCHEMA = pa.schema(
    [
        pa.field("topic", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("entry_id", pa.string(), nullable=False),
        pa.field("entry_ms", pa.int64(), nullable=False),
        pa.field("entry_seq", pa.int64(), nullable=False),
        pa.field("resource_id", pa.string()),
        pa.field("event_type", pa.string()),
        pa.field("event_time_ms", pa.int64()),
        pa.field("event_id", pa.string()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
        pa.field("data", pa.binary(), nullable=False),
    ]
)
COLUMNS = tuple(SCHEMA.names)
_DATA = len(SCHEMA) - 1
REBUILT_SCHEMA = pa.schema([*list(SCHEMA)[:_DATA], SCHEMA.field("data").with_nullable(True)])
"""`SCHEMA` of a version-3 segment: ``data`` null where rebuilt on read."""

RawEntry = tuple[EntryId, dict[bytes, bytes]]
"""An entry as read from Redis: its ID and its field map."""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a segment's metadata says: topic, shard, the key's range, entries, raw bytes."""

    topic: str
    shard: int
    first: EntryId
    last: EntryId
    entries: int
    raw_bytes: int
    typed_models: str | None = None  # typed segments: `eventbus.tier.typed.models_spec`
    typed_version: str | None = None  # `TypedPayloads.version`
    typed_invalid: int = 0  # entries of a modelled type whose payload did not validate
    data_fields: str | None = None  # version 3: `eventbus.tier.rebuild.fields_text`
    data_rebuilt: int = 0  # version 3: entries whose ``data`` is rebuilt on read


def entry_arrays(topic: str, shard: int, entries: Sequence[RawEntry]) -> list[Any]:
    """`entries` (ID, field map) as the segment schema's columns, in `SCHEMA` order: envelope
    columns null where the envelope does not decode (`entry_columns`). Used by readers of the
    Redis tail that must give the same rows as segments (`eventbus.spark`)."""
    return entry_columns(topic, shard, [str(i) for i, _ in entries], [f for _, f in entries]).arrays


def _after_previous(ms: Any, seq: Any) -> Any:
    """For rows 1..n-1 of the entry-ID columns `ms`, `seq` (n >= 2): whether each row's ID is
    after the previous row's (a boolean array of n - 1)."""
    n = len(ms)
    a_ms, b_ms, a_seq, b_seq = ms.slice(0, n - 1), ms.slice(1), seq.slice(0, n - 1), seq.slice(1)
    return pc.or_(pc.greater(b_ms, a_ms), pc.and_(pc.equal(b_ms, a_ms), pc.greater(b_seq, a_seq)))
