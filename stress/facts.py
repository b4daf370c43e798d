"""Scenario facts of a chaos run, from its ledgers: poison events, handler concurrency, the
backlog."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from ledger import DeadLetter, Handling, Ledgers


def poison_facts(led: Ledgers, dead: list[DeadLetter], max_attempts: int) -> dict[str, Any]:
    """Did other resources go on while a poison event was retried, and did the poison resource's
    later events wait until it was dead-lettered? (Until it was dead-lettered the first time:
    an ack lost in a failover delivers it again later, a duplicate, retried anew.)"""
    fails: dict[tuple[str, int], list[Handling]] = defaultdict(list)
    for h in led.handlings:
        if not h.ok:
            fails[(h.resource, h.seq)].append(h)
    ends = sorted(h.end_ns for h in led.handlings if h.ok)
    others, overtaken = [], 0
    for (r, s), runs in fails.items():
        lo = min(h.start_ns for h in runs)
        last = [h.end_ns for h in runs if h.attempt >= max_attempts]  # dead-lettered after it
        hi = min(last) if last else max(h.end_ns for h in runs)
        others.append(bisect.bisect_left(ends, hi) - bisect.bisect_right(ends, lo))
        overtaken += sum(
            1 for h in led.handlings if h.ok and h.resource == r and h.seq > s and h.end_ns < hi
        )
    attempts = sorted({d.attempts for d in dead})
    return {
        "poison_attempts_recorded": {f"{r}#{s}": len(v) for (r, s), v in sorted(fails.items())},
        "dead_letter_attempts": attempts,
        "dead_letter_attempts_ok": bool(dead) and attempts == [max_attempts],
        "min_others_handled_during_retries": min(others) if others else None,
        "poison_overtaken_by_later_seq": overtaken,
    }


def concurrency_facts(led: Ledgers) -> dict[str, Any]:
    """Most handlers running at once in one consumer process (sweep over start/end times)."""
    peak = 0
    by_consumer: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for h in led.handlings:
        by_consumer[h.consumer] += [(h.start_ns, 1), (h.end_ns, -1)]
    for marks in by_consumer.values():
        running = 0
        for _, d in sorted(marks, key=lambda m: (m[0], m[1])):
            running += d
            peak = max(peak, running)
    return {"max_concurrent_handlers": peak}


def backlog_facts(result: dict[str, Any]) -> dict[str, Any]:
    tl = result["timeline"]
    backlog, top = 0.0, 0.0
    for pub, handled in zip(tl["published_per_s"], tl["handled_per_s"], strict=True):
        backlog += pub - handled
        top = max(top, backlog)
    return {"max_backlog": int(top)}
