"""Segment layouts a bounded read can prune: row-group size, page size, page index.

    python stress/segment_layout_bench.py STORE_FOLDER [--json F]

Re-writes every segment under ``STORE_FOLDER`` (an archive, e.g. the flights of
`stress/offload_profile.py offload`) with `eventbus.tier.segment_write.write_parquet` in each layout
of `LAYOUTS`, and per layout measures: the stored bytes per entry; the CPU seconds of writing
(all segments, `time.process_time`); and for a bounded read of every segment (the rows whose
``entry_ms`` lies between the segment's entry at a quarter and the one at three quarters, as
`stress/spark_bench.py`'s ``bounded_native``) the share of rows a reader decodes: by row group
statistics (what pyarrow's and Spark's readers skip) and, with a page index, by page (what
Spark's reader further skips: ``parquet.filter.columnindex.enabled``, on by default), plus the
CPU of pyarrow's bounded read (``filters`` on ``entry_ms``) over its whole read. Prints one
JSON object. CPU times are comparable under load; wall times are not taken.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib
import time
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from eventbus.tier.segment_write import write_parquet

# (name, row group rows, page rows, page index)
LAYOUTS = [
    ("base: groups 65536, pages 20000, no page index", 65536, 20000, False),
    ("groups 65536, pages 2000, page index", 65536, 2000, True),
    ("groups 65536, pages 5000, page index", 65536, 5000, True),
    ("groups 16384, pages 20000, no page index", 16384, 20000, False),
    ("groups 8192, pages 20000, no page index", 8192, 20000, False),
    ("groups 4096, pages 20000, no page index", 4096, 20000, False),
    ("groups 16384, pages 2000, page index", 16384, 2000, True),
]
REPS = 3


def bounds(table: Any) -> tuple[int, int]:
    ms = table.column("entry_ms")
    n = len(ms)
    return ms[n // 4].as_py(), ms[3 * n // 4].as_py()


def rows_by_row_group(meta: Any, lo: int, hi: int) -> int:
    """Rows of the row groups whose ``entry_ms`` statistics overlap ``lo..hi`` (what a reader
    decodes for that range when it prunes by row group only)."""
    col = meta.schema.to_arrow_schema().get_field_index("entry_ms")
    kept = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = group.column(col).statistics
        if stats.max >= lo and stats.min <= hi:
            kept += group.num_rows
    return kept


def page_rows_kept(ms: list[int], lo: int, hi: int, group: int, page_rows: int) -> int:
    """Rows of the pages (of `page_rows` rows, within row groups of `group` rows) whose
    ``entry_ms`` range overlaps ``lo..hi``."""
    kept = 0
    for g in range(0, len(ms), group):
        rows = ms[g : g + group]
        for p in range(0, len(rows), page_rows):
            page = rows[p : p + page_rows]
            if page[-1] >= lo and page[0] <= hi:
                kept += len(page)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("store")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    files = sorted(pathlib.Path(args.store).rglob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    entries = sum(t.num_rows for t in tables)
    out: dict[str, Any] = {"segments": len(files), "entries": entries, "layouts": []}
    for name, group, page_rows, page_index in LAYOUTS:
        started = time.process_time()
        for _ in range(REPS):
            blobs = [
                write_parquet(t, row_group=group, page_rows=page_rows, page_index=page_index)
                for t in tables
            ]
        write_s = (time.process_time() - started) / REPS
        wanted = rows_group = rows_page = 0
        bounded_s = whole_s = 0.0
        for t, blob in zip(tables, blobs, strict=True):
            lo, hi = bounds(t)
            ms = t.column("entry_ms")
            wanted += pc.sum(pc.and_(pc.greater_equal(ms, lo), pc.less_equal(ms, hi))).as_py()
            meta = pq.read_metadata(io.BytesIO(blob))
            by_group = rows_by_row_group(meta, lo, hi)
            rows_group += by_group
            rows_page += (
                page_rows_kept(ms.to_pylist(), lo, hi, group, page_rows) if page_index else by_group
            )
            for _ in range(REPS):
                started = time.process_time()
                pq.read_table(
                    io.BytesIO(blob), filters=[("entry_ms", ">=", lo), ("entry_ms", "<=", hi)]
                )
                bounded_s += time.process_time() - started
                started = time.process_time()
                pq.read_table(io.BytesIO(blob))
                whole_s += time.process_time() - started
        stored = sum(map(len, blobs))
        out["layouts"].append(
            {
                "layout": name,
                "row_group": group,
                "page_rows": page_rows,
                "page_index": page_index,
                "stored_bytes_per_entry": round(stored / entries, 2),
                "write_cpu_us_per_entry": round(write_s * 1e6 / entries, 2),
                "bounded_rows_wanted_share": round(wanted / entries, 3),
                "bounded_rows_read_share_row_groups": round(rows_group / entries, 3),
                "bounded_rows_read_share_pages": round(rows_page / entries, 3),
                "pyarrow_bounded_cpu_over_whole": round(bounded_s / whole_s, 3),
                "row_groups_per_segment": round(
                    sum(math.ceil(t.num_rows / group) for t in tables) / len(tables), 1
                ),
            }
        )
        print(json.dumps(out["layouts"][-1]), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
