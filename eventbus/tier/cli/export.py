"""How ``eventbus replay`` writes what it reads: JSON lines (`entry_json`) or one Parquet file
with the segment schema (`write_parquet`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventbus.errors import EventBusError

if TYPE_CHECKING:  # the commands import pyarrow and obstore only when they run
    from eventbus.tier.archived import ArchivedEntry


def entry_json(entry: ArchivedEntry) -> dict[str, Any]:
    """One replayed entry as a JSON-able dict (payload decoded; ``error`` if it does not)."""
    out: dict[str, Any] = {
        "topic": entry.topic,
        "shard": entry.shard,
        "entry_id": str(entry.entry_id),
        "resource_id": entry.resource_id,
        "event_type": entry.event_type,
        "event_time_ms": entry.published_at_ms,
        "event_id": None if entry.event_id is None else str(entry.event_id),
        "headers": entry.headers,
    }
    try:
        out["payload"] = entry.envelope().payload
    except EventBusError as exc:
        out["error"] = str(exc)
    return out


class stdout:
    """`sys.stdout` as a context manager that does not close it."""

    def __enter__(self) -> Any:
        return sys.stdout

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()


def write_parquet(
    path: Path,
    entries: Iterable[ArchivedEntry],
    progress: Callable[[int], Any],
    batch: int = 50_000,
) -> int:
    """Write entries with the segment schema (all topics' rows in one file); returns the count.
    `progress(count)` is called after each batch of `batch` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eventbus.tier.segment import SCHEMA

    count = 0
    with pq.ParquetWriter(path, SCHEMA, compression="zstd") as writer:
        rows: list[ArchivedEntry] = []

        def flush() -> None:
            cols = {
                "topic": [e.topic for e in rows],
                "shard": [e.shard for e in rows],
                "entry_id": [str(e.entry_id) for e in rows],
                "entry_ms": [e.entry_id.ms for e in rows],
                "entry_seq": [e.entry_id.seq for e in rows],
                "resource_id": [e.resource_id for e in rows],
                "event_type": [e.event_type for e in rows],
                "event_time_ms": [e.published_at_ms for e in rows],
                "event_id": [None if e.event_id is None else str(e.event_id) for e in rows],
                "headers": [None if e.headers is None else list(e.headers.items()) for e in rows],
                "data": [e.data for e in rows],
            }
            arrays = [pa.array(cols[f.name], f.type) for f in SCHEMA]
            writer.write_table(pa.Table.from_arrays(arrays, schema=SCHEMA))
            rows.clear()

        for entry in entries:
            rows.append(entry)
            count += 1
            if len(rows) >= batch:
                flush()
                progress(count)
        if rows:
            flush()
    return count
