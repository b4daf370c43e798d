"""Object access of the Spark source: the few calls it makes on a segment store, in one class.

`Objects` wraps an obstore store (the tier's `open_store`: local folder, S3, memory). Every read
the source makes goes through `get` or `get_range` here, so a subclass returned by the
``store_factory`` option can add credentials, caching or instrumentation (the tests count reads
with one).
"""

from __future__ import annotations

import io
from typing import Any

import obstore
from obstore.exceptions import BaseError

from eventbus.tier.errors import StoreError
from eventbus.tier.layout import SegmentRef, gap_prefixes
from eventbus.tier.store import (
    Store,
    describe,
    get_bytes_sync,
    list_keys_sync,
    list_segments_sync,
    list_shards_sync,
)


class Objects:
    """Reads of one segment store. Picklable only through its URL (see `SourceOptions`)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"Objects({describe(self.store)})"

    def get(self, key: str) -> bytes:
        """The whole object. Raises `FileNotFoundError`, `StoreError`."""
        return get_bytes_sync(self.store, key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start`..`end` (exclusive) of the object. Raises `StoreError`."""
        try:
            return bytes(obstore.get_range(self.store, key, start=start, end=end))
        except (BaseError, OSError) as exc:
            raise StoreError(
                f"get {key!r} range from {describe(self.store)} failed: {exc}"
            ) from exc

    def shards(self, topic: str) -> list[int]:
        """Shard folders present for `topic`, ascending."""
        return list_shards_sync(self.store, topic)

    def segments(self, topic: str, shard: int, after: SegmentRef | None = None) -> list[SegmentRef]:
        """The shard's segments in entry-ID order (only keys after `after`'s, when given)."""
        return list_segments_sync(self.store, topic, shard, after=after)

    def gaps(self, topic: str, shard: int) -> list[dict[str, Any]]:
        """The shard's gap records (`eventbus.tier.gaps.parse_gap` dicts, with their ``key``),
        in key order. Raises `CorruptGapRecord` naming a damaged one, `StoreError`."""
        # the tier's gap records import pydantic and the tier's metrics (prometheus): only
        # when a shard has a record (rare), not in every stream planner's micro-batch
        if not any(list_keys_sync(self.store, p) for p in gap_prefixes(topic, shard)):
            return []
        from eventbus.tier.gaps import gap_records

        return gap_records(self.store, topic, shard, get=self.get)


def as_objects(store: Any) -> Objects:
    """`store` itself when it is an `Objects`, else an `Objects` around an obstore store."""
    return store if isinstance(store, Objects) else Objects(store)


def parquet_footer(objects: Objects, ref: SegmentRef, guess: int = 65536) -> Any:
    """The Parquet metadata of segment `ref`, from ranged reads of its end only (usually one
    GET of the last `guess` bytes). Raises `StoreError`, or pyarrow's errors when damaged."""
    import pyarrow.parquet as pq  # here: the stream's planner reads footers only to count

    size = ref.size
    tail = objects.get_range(ref.key, max(0, size - guess), size)
    n = int.from_bytes(tail[-8:-4], "little")
    if tail[-4:] != b"PAR1" or n + 8 > size:
        raise ValueError("not a Parquet file end")
    if n + 8 > len(tail):
        tail = objects.get_range(ref.key, size - n - 8, size)
    return pq.read_metadata(io.BytesIO(b"PAR1" + tail[-(n + 8) :]))
