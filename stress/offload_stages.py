"""CPU per offloaded entry by stage, from py-spy's collapsed stacks of `stress/offload_profile.py`.

    py-spy record --native --threads --format raw -r 100 -o F.raw -- \\
        python stress/offload_profile.py offload /tmp/store
    python stress/offload_stages.py F.raw --entries 336776 [--rate 100]

py-spy samples every thread that is running (not idle), so a sample is CPU time of that thread:
microseconds per entry = samples x (1e6 / rate) / entries. Start-up (imports, the warm-up
`encode_segment`, loading the flights) is left out. Each stack goes to the first stage whose
pattern its frames match, searched from the leaf up (so a stage is where the time is spent, not
who called it); prints a Markdown table and the per-thread totals. Under load py-spy also
counts threads that wait for a CPU (and with ``--native`` some waits): read the shares, and
scale them by the CPU per entry measured without the profiler (`offload_profile.py`'s
``cpu_us_per_entry``); waits on a condition or the selector are shown apart ("idle").
"""

from __future__ import annotations

import argparse
import collections
import re

# (stage, patterns): the deepest frame matching a pattern names the stage
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("cyclic GC (young and full collections, in any thread)", (r"gc_collect",)),
    (
        "idle: worker threads and the event loop waiting (not CPU)",
        (
            r"Condition\.wait",
            r"EpollSelector\.select",
            r"epoll_wait",
        ),
    ),
    (
        "Parquet encode + zstd (pq.write_table, order check)",
        (
            r"encode_columns \(eventbus/tier/segment\.py:(5[89]\d)\)",
            r"\(parquet",
            r"_misplaced",
            r"Table\.from_arrays",
            r"libparquet",
            r"libzstd",
            r"ZSTD_",
            r"_parquet",
        ),
    ),
    (
        "typed columns (validation, struct, data rebuild check)",
        (
            r"eventbus/tier/typed\.py",
            r"eventbus/tier/rebuild\.py",
            r"_reencoded",
            r"encode_columns \(eventbus/tier/segment\.py",
        ),
    ),
    (
        "envelope + header decode, raw columns (IDs, rid/type, UUIDs, maps)",
        (
            r"_decode_all",
            r"_field_lists",
            r"_texts",
            r"_uuid_text",
            r"_map_array",
            r"_fixed",
            r"_zeros",
            r"entry_columns",
            r"_entry_by_entry",
            r"ShardOffload\.put\.<locals>\.encode",
        ),
    ),
    (
        "object-store put, segment listing",
        (
            r"eventbus/tier/store\.py",
            r"obstore",
        ),
    ),
    (
        "checkpoint, locks, trim, gap check",
        (
            r"eventbus/tier/checkpoint\.py",
            r"ShardOffload\.trim",
            r"xtrim",
            r"xinfo",
            r"eventbus/locking/",
            r"find_gap",
            r"TopicOffloader\.lock",
        ),
    ),
    (
        "XRANGE + reply parsing, buffer accounting",
        (
            r"ShardOffload\.xrange",
            r"ShardOffload\.fill",
            r"execute_packed",
            r"hiredis",
            r"redis/",
            r"rows_bytes",
            r"row_bytes",
            r"dictionary_rows",
        ),
    ),
    ("event loop, thread hand-off, rest", (r".",)),
]

STARTUP = re.compile(r"_find_and_load|encode_segment \(|load_flights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("raw")
    parser.add_argument("--entries", type=int, required=True)
    parser.add_argument("--rate", type=int, default=100, help="py-spy's -r (samples/s)")
    args = parser.parse_args()
    compiled = [(name, [re.compile(p) for p in pats]) for name, pats in STAGES]
    stages: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    startup = 0
    with open(args.raw) as f:
        lines = f.readlines()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        if STARTUP.search(stack):
            startup += n
            continue
        threads["main" if "MainThread" in frames[0] else "workers"] += n
        stage = _stage(frames[1:], compiled)
        stages[stage] += n
    us = 1e6 / args.rate / args.entries
    idle = next(name for name, _ in STAGES if name.startswith("idle"))
    total = sum(n for name, n in stages.items() if name != idle)
    print("| stage | CPU us/entry | share |")
    print("|---|---|---|")
    for name, _ in STAGES:
        share = "" if name == idle else f"{stages[name] / max(1, total):.0%}"
        print(f"| {name} | {stages[name] * us:.2f} | {share} |")
    print(f"| **total (idle left out)** | **{total * us:.2f}** | |")
    print()
    print(
        f"threads: main {threads['main'] * us:.2f} us/entry, "
        f"workers {threads['workers'] * us:.2f} us/entry; start-up {startup} samples left out"
    )


def _stage(frames: list[str], compiled: list[tuple[str, list[re.Pattern[str]]]]) -> str:
    for frame in reversed(frames):
        for name, pats in compiled:
            if name.startswith("event loop"):
                continue
            if any(p.search(frame) for p in pats):
                return name
    return compiled[-1][0]


if __name__ == "__main__":
    main()
