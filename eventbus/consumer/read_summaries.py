"""Which ``XPENDING`` summaries of fenced delivery a single node's read round sends with the read,
ahead of its reply (`Streaks`), rather than in a second round trip once the reply says which
streams gave entries (`eventbus.consumer.reading`; docs/protocol.md, "Fenced delivery")."""

from __future__ import annotations

AHEAD_AFTER = 3
"""A stream's summary goes in its read's round trip, before the read's reply tells whether it
has entries, once it gave entries to this many of its reads in a row (`Streaks`)."""


class Streaks:
    """Which streams' ``XPENDING`` summaries to send with a read, ahead of its reply.

    A summary sent ahead saves the second round trip when the read returns entries of its
    stream, and is Redis work for nothing when it does not. Arrivals at a low rate are
    memoryless: measured at 2,000 events/s over 16 shards (`stress/redis_cost.py`), a stream
    that gave two entries to a read gave any to the next in 5 % of cases, so sending its summary
    ahead (the rule before) wasted ~0.1 ``XPENDING`` per event. A stream that gave entries to
    `AHEAD_AFTER` reads in a row is read with entries at every read (a busy shard: the round
    trip saved is what matters), a trickle rarely so."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: dict[str, int] = {}  # stream -> reads in a row that gave it entries

    def ahead(self, streams: list[str]) -> list[int]:
        """Indexes in `streams` (the streams of the next read) whose summary goes with it."""
        runs = self._runs
        if not runs:
            return []
        return [i for i, s in enumerate(streams) if runs.get(s, 0) >= AHEAD_AFTER]

    def update(self, streams: list[str], read_from: set[str]) -> None:
        """After a read of `streams` that returned entries of the streams `read_from`: their runs
        grow; the runs of the other streams read end (a stream not read, a full shard waiting for
        room, keeps its run)."""
        runs = self._runs
        for s in read_from:
            runs[s] = runs.get(s, 0) + 1
        if len(runs) > len(read_from):
            read = set(streams)
            for s in [s for s in runs if s not in read_from and s in read]:
                del runs[s]
