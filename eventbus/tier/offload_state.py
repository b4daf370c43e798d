"""What the offloader keeps per held shard (`OffloadShard`) and how it handles the rows it read
(`Row`: an XRANGE reply entry, kept as read until its segment is written).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from eventbus.protocol.codec import F_DATA, encoded_size
from eventbus.protocol.dictionaries import DICT_FORMATS
from eventbus.protocol.ids import EntryId, parse_id

Row = Sequence[Any]
"""An entry as XRANGE replies: ``[id, fields]``, the ID ``b"<ms>-<seq>"``, the fields a raw list
``[name, value, ...]`` (one node: `execute_packed`'s replies) or a field map (a Cluster's
pipeline parses them). Kept as read: the columns are built for a whole segment at once."""


def row_bytes(rows: Sequence[Row]) -> list[int]:
    """Per row the bytes of its field names and values (what counts against
    `max_payload_bytes`)."""
    return [sum(map(len, f)) if type(f) is list else encoded_size(f) for _, f in rows]


def rows_bytes(rows: Sequence[Row]) -> int:
    """`row_bytes` summed: on raw lists (one node) without a Python step per row."""
    fields = [f for _, f in rows]
    if set(map(type, fields)) <= {list}:
        return sum(map(len, chain.from_iterable(fields)))
    return sum(row_bytes(rows))


def _data_of(fields: Any) -> bytes:
    """The ``data`` field of a row's fields (b"" when missing)."""
    if type(fields) is list:
        if len(fields) == 6 and fields[4] == F_DATA:  # as publishers write them
            return fields[5]  # type: ignore[no-any-return]
        fields = dict(zip(fields[::2], fields[1::2], strict=True))
    return fields.get(F_DATA, b"")  # type: ignore[no-any-return]


def dictionary_rows(rows: Sequence[Row]) -> list[Any]:
    """The rows (as `archive_dictionaries` takes them) whose ``data`` is compressed with a zstd
    dictionary: those dictionaries go to the store, and into this process's cache, before the
    segment is encoded (its envelope columns need them) and put."""
    fields = [f for _, f in rows]
    standard = (
        set(map(type, fields)) <= {list}
        and set(map(len, fields)) <= {6}
        and {f[4] for f in fields} <= {F_DATA}
    )
    if standard and not {f[5][:1] for f in fields} & _DICT_PREFIXES:
        return []  # as publishers write them, none with a dictionary: no Python step per row
    datas = [_data_of(f) for f in fields]
    return [(None, {F_DATA: d}) for d in datas if d[:1] in _DICT_FORMAT_BYTES]


_DICT_FORMAT_BYTES = tuple(bytes([f]) for f in DICT_FORMATS)
_DICT_PREFIXES = set(_DICT_FORMAT_BYTES)


@dataclass
class OffloadShard:
    """The offload state of a held shard lock (`token` is its fencing token); dropped with it."""

    shard: int
    token: int
    stream: str
    checkpoint: EntryId | None = None
    count: int = 0  # entries accounted for (archived + recorded lost)
    buffer: list[Row] = field(default_factory=list)  # read, not archived yet, in ID order
    buffer_bytes: int = 0
    read_to: EntryId | None = None  # last entry read into the buffer (or the checkpoint)
    recovered: bool = False
    gaps_seen: set[str] = field(default_factory=set)
    unrecorded: str | None = None  # a gap accounted in Redis whose record is not stored yet

    def reset_to(self, checkpoint: EntryId | None, count: int) -> None:
        self.checkpoint, self.count = checkpoint, count
        if checkpoint is not None and self.buffer:  # drop the rows up to it (IDs increase)
            keep = bisect.bisect_right(self.buffer, checkpoint, key=lambda r: parse_id(r[0]))
            if keep:
                self.buffer = self.buffer[keep:]
                self.buffer_bytes = rows_bytes(self.buffer)
        self.read_to = parse_id(self.buffer[-1][0]) if self.buffer else checkpoint
