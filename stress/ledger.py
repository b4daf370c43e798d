"""Ledgers of a chaos run and the checks made on them.

Every publisher and consumer process writes its own ledger file of tab-separated lines:

* ``R  <pid>``                                        a consumer catches SIGTERM from now on
* ``C  <consumer id>  <pid>``                          a consumer's identity (at its first event)
* ``P  <resource>  <seq>  <entry id>  <acked ns>  <flags>``  a publish Redis acknowledged
* ``F  <resource>  <seq>  -  <failed ns>  <error>``    a publish that raised (not acknowledged)
* ``H  <resource>  <seq>  <entry id>  <token>  <shard>  <attempt>  <start ns>  <end ns>
  <published ms>  <event id>  <fenced>``               a handler run that returned; `fenced` is
  whether the library's fence (a valid lease, the shard held under that token) still held at the
  handler's first line: 1, 0, or - when unknown
* ``X  ...same fields...``                             a handler run that raised
* ``E  <peak rss kB>``                                 a consumer's clean exit

Consumers append each line with one ``write(2)`` on an ``O_APPEND`` descriptor before the handler
returns. The library acks only after the handler returned, so a SIGKILL can lose the record of a
handler run only if that entry was not acked yet: it stays pending, is handled again by the next
owner and gets a record then. A SIGKILL never leaves half a line from a completed write; a torn
last line (if any) is skipped by the reader.

Times are wall-clock ``time.time_ns()`` of one machine, so records of different processes can be
merged on one time axis.
"""

from __future__ import annotations

import bisect
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

HELLO, PUBLISHED, PUBLISH_FAILED, HANDLED, RAISED = "C", "P", "F", "H", "X"
READY, EXITED = "R", "E"


class LineWriter:
    """Appends lines to a ledger file. Unbuffered: one ``write(2)`` per line, so that a line is
    on its way to disk (in the page cache, which survives the process) before the caller goes
    on. `buffered` collects lines until `flush()`, for processes that are never killed."""

    def __init__(self, path: Path, *, buffered: bool = False) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._buffered = buffered
        self._lines: list[str] = []

    def write(self, *fields: object) -> None:
        line = "\t".join(map(str, fields)) + "\n"
        if self._buffered:
            self._lines.append(line)
        else:
            os.write(self._fd, line.encode())

    def flush(self) -> None:
        if self._lines:
            data, self._lines = "".join(self._lines).encode(), []
            os.write(self._fd, data)

    def close(self) -> None:
        self.flush()
        os.close(self._fd)


class Published(NamedTuple):
    resource: str
    seq: int
    entry_id: str
    acked_ns: int
    flags: str  # "p" poison, "s" slow, "-" plain


class Handling(NamedTuple):
    consumer: int  # index of the consumer process (its ledger file)
    ok: bool
    resource: str
    seq: int
    entry_id: str
    token: int
    shard: int
    attempt: int
    start_ns: int
    end_ns: int
    published_ms: int
    event_id: str
    fenced: bool | None = None  # the fence held at the handler's first line (None: unknown)


@dataclass
class Ledgers:
    """Everything read back from one run's ledger files."""

    published: list[Published] = field(default_factory=list)
    publish_failed: list[tuple[str, int, int, str]] = field(default_factory=list)
    handlings: list[Handling] = field(default_factory=list)
    consumer_ids: dict[int, str] = field(default_factory=dict)
    peak_rss_kb: dict[int, int] = field(default_factory=dict)
    torn_lines: int = 0


def _lines(path: Path) -> Iterator[list[str] | None]:
    """Split lines of `path`; None for a torn (unterminated or short) line."""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            yield line[:-1].split("\t") if line.endswith("\n") else None


def read_publisher(path: Path, into: Ledgers) -> None:
    for parts in _lines(path):
        if parts is None or len(parts) < 6:
            into.torn_lines += 1
        elif parts[0] == PUBLISHED:
            into.published.append(
                Published(parts[1], int(parts[2]), parts[3], int(parts[4]), parts[5])
            )
        elif parts[0] == PUBLISH_FAILED:
            into.publish_failed.append((parts[1], int(parts[2]), int(parts[4]), parts[5]))


def read_consumer(path: Path, index: int, into: Ledgers) -> None:
    for parts in _lines(path):
        if parts is None:
            into.torn_lines += 1
        elif parts[0] in (HANDLED, RAISED) and len(parts) in (11, 12):
            into.handlings.append(
                Handling(
                    index,
                    parts[0] == HANDLED,
                    parts[1],
                    int(parts[2]),
                    parts[3],
                    int(parts[4]),
                    int(parts[5]),
                    int(parts[6]),
                    int(parts[7]),
                    int(parts[8]),
                    int(parts[9]),
                    parts[10],
                    {"1": True, "0": False}.get(parts[11]) if len(parts) == 12 else None,
                )
            )
        elif parts[0] == HELLO and len(parts) >= 2:
            into.consumer_ids[index] = parts[1]
        elif parts[0] == READY:
            pass
        elif parts[0] == EXITED and len(parts) >= 2:
            into.peak_rss_kb[index] = int(parts[1])
        else:
            into.torn_lines += 1


def read_run(workdir: Path) -> Ledgers:
    """Read ``pub-<i>.log`` and ``con-<i>.log`` of a run folder."""
    led = Ledgers()
    for path in sorted(workdir.glob("pub-*.log")):
        read_publisher(path, led)
    for path in sorted(workdir.glob("con-*.log")):
        read_consumer(path, int(path.stem.split("-")[1]), led)
    return led


def replicas_short(error: str) -> bool:
    """Whether a publish failed because WAIT found too few replicas (``publish_replicas``): the
    event is stored on the primary, a replica was not in sync (a restart, a failover)."""
    return "replicas confirmed within" in error or "WAIT failed" in error


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


@dataclass(frozen=True)
class DeadLetter:
    resource: str
    seq: int
    entry_id: str
    attempts: int
    error_type: str


def check(
    led: Ledgers,
    dead_letters: Iterable[DeadLetter],
    faults: list[dict[str, Any]],
    t0_ns: int,
    *,
    examples: int = 10,
) -> dict[str, Any]:
    """The figures of a run. Adds ``takeover_s`` (and ``takeover_all_s``) to each fault that has
    a ``victim`` and ``victim_shards``, in place.

    * lost: acknowledged publishes with neither a successful handling nor a dead-letter record;
    * order violations: per resource, take the first successful handling of each seq in order of
      handling time (re-deliveries collapsed); every seq must be above all seqs before it (seqs
      whose publish raised and was never acknowledged are left out: their copies may land late,
      counted as ``failed_publish_out_of_order``);
    * duplicates: successful handlings beyond the first of a (resource, seq), split into
      re-deliveries of one entry and copies stored twice by a publisher retry (other entry ID).
    """
    acked = {(p.resource, p.seq): p for p in led.published}
    unacked_failed = {(r, s) for r, s, _, _ in led.publish_failed} - acked.keys()
    oks = sorted((h for h in led.handlings if h.ok), key=lambda h: h.end_ns)
    first: dict[tuple[str, int], Handling] = {}
    redelivered = republished = failed_late = 0
    violations: list[dict[str, Any]] = []
    violation_count = 0
    top: dict[str, int] = {}
    for h in oks:
        key = (h.resource, h.seq)
        seen = first.get(key)
        if seen is not None:
            if seen.entry_id == h.entry_id:
                redelivered += 1
            else:
                republished += 1
            continue
        first[key] = h
        prev = top.get(h.resource, 0)
        if key in unacked_failed:
            # publish() raised: the caller was told it may or may not be stored, and it went on
            # with the next seq; a copy still in flight (a partition) can land after later ones.
            # Not part of the order contract: counted apart.
            failed_late += h.seq < prev
            continue
        if h.seq < prev:
            violation_count += 1
            if len(violations) < examples:
                violations.append(_violation(h, prev, first))
        else:
            top[h.resource] = h.seq

    dead = list(dead_letters)
    dead_keys = {(d.resource, d.seq) for d in dead}
    poison = {k for k, p in acked.items() if "p" in p.flags}
    lost_keys = sorted(k for k in acked if k not in first and k not in dead_keys)
    unknown = [k for k in first if k not in acked and k not in unacked_failed]

    stale_count, stale_runs = stale_token_starts(led.handlings, examples=1 << 30)
    woken = _woken(stale_runs, faults)
    latencies = sorted((h.start_ns / 1e6 - h.published_ms) for h in first.values())
    t_end = max((h.end_ns for h in first.values()), default=t0_ns)
    t_pub = [p.acked_ns for p in led.published]
    out: dict[str, Any] = {
        "events": len(acked),
        "publish_failed": len(led.publish_failed),
        "publish_failed_replicas_short": sum(
            1 for *_, err in led.publish_failed if replicas_short(err)
        ),
        "handled": len(first),
        "handler_runs": len(led.handlings),
        "lost": len(lost_keys),
        "lost_examples": [_lost_example(k, acked[k], led) for k in lost_keys[:examples]],
        "order_violations": violation_count,
        "violation_examples": violations,
        "duplicates": redelivered + republished,
        "duplicates_redelivered": redelivered,
        "duplicates_republished": republished,
        "dead_lettered": len(dead_keys),
        "dead_letter_records": len(dead),
        "poison_events": len(poison),
        "poison_not_dead_lettered": sorted(f"{r}#{s}" for r, s in poison - dead_keys),
        "unexpected_dead_letters": sorted(f"{r}#{s}" for r, s in dead_keys - poison)[:examples],
        "unexpected_dead_letter_count": len(dead_keys - poison),
        "handled_but_publish_failed": sum(1 for k in first if k in unacked_failed),
        "failed_publish_out_of_order": failed_late,
        "handled_unknown": len(unknown),
        "torn_ledger_lines": led.torn_lines,
        "stale_token_starts": stale_count,
        "stale_token_examples": stale_runs[:examples],
        "stale_token_starts_at_sigcont": len(woken),
        "stale_token_at_sigcont_examples": woken[:examples],
        "events_per_s": len(first) / max(1e-9, (t_end - t0_ns) / 1e9),
        "publish_per_s": len(t_pub) / max(1e-9, (max(t_pub, default=t0_ns) - t0_ns) / 1e9),
        "handling_s": (t_end - t0_ns) / 1e9,
        "latency_ms_p50": percentile(latencies, 0.50),
        "latency_ms_p99": percentile(latencies, 0.99),
        "latency_ms_max": latencies[-1] if latencies else None,
    }
    _takeovers(oks, faults)
    times = [f["takeover_s"] for f in faults if f.get("takeover_s") is not None]
    out["takeover_s_median"] = statistics.median(times) if times else None
    out["takeover_s_max"] = max(times) if times else None
    out["timeline"] = timeline(first.values(), led.published, t0_ns)
    return out


def _violation(h: Handling, prev: int, first: dict[tuple[str, int], Handling]) -> dict[str, Any]:
    before = first[(h.resource, prev)]
    return {
        "resource": h.resource,
        "seq": h.seq,
        "after_seq": prev,
        "handled": _describe(h),
        "earlier_handling_of_after_seq": _describe(before),
    }


def _describe(h: Handling) -> dict[str, Any]:
    return {
        "consumer": h.consumer,
        "entry_id": h.entry_id,
        "token": h.token,
        "shard": h.shard,
        "attempt": h.attempt,
        "start_ns": h.start_ns,
        "end_ns": h.end_ns,
        "fenced": h.fenced,
    }


def _lost_example(key: tuple[str, int], p: Published, led: Ledgers) -> dict[str, Any]:
    runs = [_describe(h) | {"ok": h.ok} for h in led.handlings if (h.resource, h.seq) == key]
    return {
        "resource": key[0],
        "seq": key[1],
        "entry_id": p.entry_id,
        "acked_ns": p.acked_ns,
        "handler_runs": runs,
    }


WAKE_SLACK_NS = 100_000_000


def _woken(stale_runs: list[dict[str, Any]], faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stale runs (`stale_token_starts` examples) that are the documented limit of a process
    stopped between the library's synchronous fence check and the handler's first line
    (docs/semantics.md, limit 2; FINDINGS 7): per SIGSTOP of a consumer, its first stale start
    in the stop (so at the SIGCONT) or within `WAKE_SLACK_NS` after it, if the fence no longer
    held at that handler's first line (``fenced`` False: the lease ran out meanwhile). A stopped
    process is in that window for one handler call at most. A start at which the library still
    believed it held the shard under a valid lease (``fenced`` True) is a gap in the fence, not
    that limit, however close to a SIGCONT (FINDINGS 10); ledgers without the flag (None) are
    judged by the time alone."""
    out = []
    for f in faults:
        if f["kind"] != "pause":
            continue
        lo, hi = f["t_ns"], f.get("end_ns", f["t_ns"]) + WAKE_SLACK_NS
        inside = [
            x
            for x in stale_runs
            if x["run"]["consumer"] == f.get("victim") and lo <= x["run"]["start_ns"] <= hi
        ]
        if inside:
            first = min(inside, key=lambda x: x["run"]["start_ns"])
            if first["run"].get("fenced") is not True:
                out.append(first)
    return out


def stale_token_starts(
    handlings: list[Handling], examples: int = 10
) -> tuple[int, list[dict[str, Any]]]:
    """Handler runs that started after a run with a higher fencing token had completed on the
    same shard: work done by an owner that had already been replaced (fencing is what lets a
    downstream store refuse it). Returns the count and a few examples, each with the
    higher-token run it came after."""
    by_shard: dict[int, list[Handling]] = defaultdict(list)
    for h in handlings:
        by_shard[h.shard].append(h)
    stale, found = 0, []
    for runs in by_shard.values():
        ends = sorted(runs, key=lambda h: h.end_ns)
        end_ns = [h.end_ns for h in ends]
        top: Handling | None = None
        prefix_max: list[Handling] = []
        for h in ends:
            if top is None or h.token > top.token:
                top = h
            prefix_max.append(top)
        for h in runs:
            i = bisect.bisect_left(end_ns, h.start_ns)
            if i and prefix_max[i - 1].token > h.token:
                stale += 1
                if len(found) < examples:
                    found.append(
                        {
                            "run": _describe(h) | {"resource": h.resource, "seq": h.seq},
                            "after": _describe(prefix_max[i - 1]),
                        }
                    )
    return stale, found


def _takeovers(oks: list[Handling], faults: list[dict[str, Any]]) -> None:
    """Time from a fault on a consumer to the first event another consumer handled on a shard
    the victim held (``takeover_s``), and until that happened on all of them
    (``takeover_all_s``). Only handler runs that started after the fault count: one that began
    before it is a previous owner finishing, not a takeover."""
    by_shard: dict[int, list[Handling]] = defaultdict(list)
    for h in oks:  # already in end_ns order
        by_shard[h.shard].append(h)
    ends = {s: [h.end_ns for h in hs] for s, hs in by_shard.items()}
    for f in faults:
        if f.get("victim") is None or not f.get("victim_shards"):
            continue
        firsts = []
        # measurable only if anyone handled an event on those shards after the fault
        f["traffic_after"] = any(
            ends.get(s) and ends[s][-1] > f["t_ns"] for s in f["victim_shards"]
        )
        for s in f["victim_shards"]:
            hs = by_shard.get(s, [])
            i = bisect.bisect_right(ends.get(s, []), f["t_ns"])
            while i < len(hs) and (hs[i].consumer == f["victim"] or hs[i].start_ns <= f["t_ns"]):
                i += 1
            if i < len(hs):
                firsts.append((hs[i].end_ns - f["t_ns"]) / 1e9)
        f["takeover_s"] = min(firsts) if firsts else None
        f["takeover_all_s"] = max(firsts) if len(firsts) == len(f["victim_shards"]) else None


def timeline(
    first: Iterable[Handling], published: list[Published], t0_ns: int, bin_s: float = 1.0
) -> dict[str, list[float | None]]:
    """Per `bin_s` bin since `t0_ns`: events handled and published per second, latency p50/p99
    (ms) of the events handled in that bin."""
    handled: dict[int, list[float]] = defaultdict(list)
    for h in first:
        handled[int((h.end_ns - t0_ns) / 1e9 / bin_s)].append(h.start_ns / 1e6 - h.published_ms)
    pubs: dict[int, int] = defaultdict(int)
    for p in published:
        pubs[int((p.acked_ns - t0_ns) / 1e9 / bin_s)] += 1
    n = max([*handled, *pubs, 0]) + 1
    t, hr, pr, p50, p99 = [], [], [], [], []
    for b in range(n):
        lat = sorted(handled.get(b, []))
        t.append(b * bin_s)
        hr.append(len(lat) / bin_s)
        pr.append(pubs.get(b, 0) / bin_s)
        p50.append(percentile(lat, 0.5))
        p99.append(percentile(lat, 0.99))
    return {
        "t_s": t,
        "handled_per_s": hr,
        "published_per_s": pr,
        "latency_ms_p50": p50,
        "latency_ms_p99": p99,
    }
