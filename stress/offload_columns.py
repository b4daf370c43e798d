"""CPU per entry of the offloader's column build and segment encode, without Redis or a store.

    python stress/offload_columns.py --events 336776 --runs 3          # typed, as the flights job
    python stress/offload_columns.py --untyped
    PYTHONPATH=.cache/ab/pkg-<sha>:. python stress/offload_columns.py  # another tree's eventbus
    python stress/offload_columns.py --vs base-s7 --runs 3   # in-process A/B against a revision

Builds the flights' entries as the offloader reads them (XRANGE's raw replies: ``[id, [b"rid",
rid, b"type", type, b"data", data]]``, entry IDs increasing), spread over 16 shards, then times
(`time.process_time`: all threads, so comparable on a loaded machine, unlike wall time), per
segment of up to 100,000 entries as the offloader cuts them: ``entry_columns`` (the envelope and
header decode, the raw and typed columns) and ``encode_columns`` (order check, ``data`` rebuild
check, Parquet + zstd). Prints one JSON object: microseconds of CPU per entry of each stage,
the median of ``--runs`` runs, and stored bytes per entry. For the whole offload (XRANGE, event
loop, GC of the process) see `stress/offload_profile.py` and ``stress/tier_bench.py``.

``--vs REV``: an A/B in one process, the fairest on a loaded machine: REV's
``eventbus/tier/segment.py`` (a revision from before the write side left it: ``git show``,
loaded as a module of its own beside this tree's other modules) and this tree's functions run
on each segment in turn, alternating which goes first; prints the medians over segments and
runs of each side's CPU per entry and the ratios (this tree over REV).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from eventbus.protocol.codec import encode_entry, envelope_of
from eventbus.protocol.ids import parse_id

try:  # the write side's own modules (segment.py held them before)
    from eventbus.tier.segment_columns import entry_columns
    from eventbus.tier.segment_write import encode_columns
except ImportError:
    from eventbus.tier.segment import encode_columns, entry_columns  # type: ignore[no-redef]
from eventbus.tier.typed import TypedPayloads
from examples.flights.flightdata import Flight, load_flights

SHARDS = 16
SEGMENT = 100_000


def pages(events: int) -> list[tuple[int, list[bytes], list[list[bytes]]]]:
    """The entries of each shard (IDs and raw field lists), cut into segments."""
    by_shard: dict[int, tuple[list[bytes], list[list[bytes]]]] = {}
    ms = 1_700_000_000_000
    for i, row in enumerate(load_flights(limit=events)):
        f = encode_entry(envelope_of(row.plane, row.event()))
        ids, fields = by_shard.setdefault(hash(row.plane) % SHARDS, ([], []))
        ids.append(f"{ms + i // 3}-{i % 3}".encode())
        fields.append([b"rid", f[b"rid"], b"type", f[b"type"], b"data", f[b"data"]])
    out = []
    for shard, (ids, fields) in sorted(by_shard.items()):
        for s in range(0, len(ids), SEGMENT):
            out.append((shard, ids[s : s + SEGMENT], fields[s : s + SEGMENT]))
    return out


def old_segment(rev: str) -> ModuleType:
    """`rev`'s ``eventbus/tier/segment.py`` as a module of its own (``segment_<rev>``)."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:eventbus/tier/segment.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="offload-columns-")) / "segment_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("segment_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["segment_old"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def versus(segments: list, typed: Any, rebuild: bool, old: ModuleType, runs: int) -> dict:
    """Per segment, `old`'s and this tree's column build + encode, alternately first."""
    sides = {"old": (old.entry_columns, old.encode_columns), "new": (entry_columns, encode_columns)}
    times: dict[str, list[float]] = {f"{s}_{k}": [] for s in sides for k in ("columns", "encode")}
    for rep in range(runs):
        for i, (shard, ids, fields) in enumerate(segments):
            first, last = parse_id(ids[0]), parse_id(ids[-1])
            order = list(sides) if (i + rep) % 2 == 0 else list(sides)[::-1]
            for side in order:
                build, encode = sides[side]
                t0 = time.process_time()
                cols = build("bench", shard, ids, fields, typed)
                t1 = time.process_time()
                encode("bench", shard, first, last, cols, typed=typed, rebuild_data=rebuild)
                t2 = time.process_time()
                times[f"{side}_columns"].append((t1 - t0) * 1e6 / len(ids))
                times[f"{side}_encode"].append((t2 - t1) * 1e6 / len(ids))
    out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    for k in ("columns", "encode"):
        out[f"ratio_{k}"] = round(out[f"new_{k}"] / out[f"old_{k}"], 3)
    total = (out["new_columns"] + out["new_encode"]) / (out["old_columns"] + out["old_encode"])
    return {**out, "ratio_total": round(total, 3)}


def run(segments: list, typed: TypedPayloads | None, rebuild: bool) -> dict[str, float]:
    columns = encode = 0.0
    stored = entries = 0
    for shard, ids, fields in segments:
        t0 = time.process_time()
        cols = entry_columns("bench", shard, ids, fields, typed)
        t1 = time.process_time()
        first, last = parse_id(ids[0]), parse_id(ids[-1])
        data, info = encode_columns(
            "bench", shard, first, last, cols, typed=typed, rebuild_data=rebuild
        )
        t2 = time.process_time()
        columns, encode = columns + t1 - t0, encode + t2 - t1
        stored, entries = stored + len(data), entries + info.entries
    return {
        "entry_columns_us": columns * 1e6 / entries,
        "encode_columns_us": encode * 1e6 / entries,
        "total_us": (columns + encode) * 1e6 / entries,
        "stored_bytes_per_entry": stored / entries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--events", type=int, default=336_776)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--untyped", action="store_true")
    parser.add_argument("--keep-data", action="store_true", help="rebuild_data off")
    parser.add_argument("--vs", default=None, help="in-process A/B against this revision")
    args = parser.parse_args()
    old = old_segment(args.vs) if args.vs else None
    segments = pages(args.events)
    typed = None if args.untyped else TypedPayloads({None: Flight})
    gc.collect()
    gc.freeze()  # the set-up's objects out of the collected generations, as the offloader's
    if old is not None:
        result = versus(segments, typed, not args.keep_data, old, args.runs)
        print(
            json.dumps({"events": args.events, "typed": typed is not None, "vs": args.vs, **result})
        )
        return
    runs = [run(segments, typed, not args.keep_data) for _ in range(args.runs + 1)][1:]
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    print(json.dumps({"events": args.events, "typed": typed is not None, "runs": runs, **out}))


if __name__ == "__main__":
    main()
