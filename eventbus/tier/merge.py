"""The merge of shards' entry batches into one entry-ID order (`merge_batches`, used by
`eventbus.tier.replay.iter_topic`): by batch cursors, not entry by entry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from eventbus.tier.archived import ArchivedEntry, EntryBatch

CHUNK_ROWS = 8192
"""Rows of a shard's batch made into entries at once by the merge (the most: fewer with more
than 16 shards); replay's batches are as long (`eventbus.tier.replay.BATCH_ROWS`)."""


def merge_batches(
    shards: Sequence[Iterator[EntryBatch]], *, chunk: int | None = None
) -> Iterator[list[ArchivedEntry]]:
    """Merge the batch streams of `shards` (each in entry-ID order, no batch empty) into one
    entry-ID order, ties between shards broken by their place in `shards` (shard index, as
    `iter_topic` lists them), as lists of entries.

    By batch cursors, never entry by entry: each round takes the smallest last entry ID of the
    shards' current batches (the *horizon*: no entry after it can come before an entry up to it
    in any shard), and hands on every current row up to it (found by bisecting each batch's ID
    columns), made entries and ordered by an Arrow ``sort_indices`` on the ID columns; a shard
    whose rows up to the horizon are the only ones goes on whole, unsorted (a shard behind the
    others, or the last one left). A shard whose batch is consumed moves on to its next.

    Rows become Python objects when first handed on, a chunk of a batch at a time
    (`_Cursor.take`), each chunk once however many rounds hand it on in pieces (making each
    piece apart doubled the merge's cost). `chunk` rows: by default `CHUNK_ROWS` up to 16
    shards, fewer beyond, at least 1,024; so a merge holds about ``16 * CHUNK_ROWS`` made
    entries up to 128 shards, 1,024 per shard beyond."""
    cursors: list[_Cursor] = []
    if chunk is None:
        chunk = max(1024, min(CHUNK_ROWS, CHUNK_ROWS * 16 // max(1, len(shards))))
    for rank, it in enumerate(shards):
        batch = next(it, None)
        if batch is not None:
            cursors.append(_Cursor(rank, it, batch, chunk))
    while cursors:
        if len(cursors) == 1:
            (c,) = cursors
            yield c.take(c.pos, c.batch.n)
            for batch in c.rest:
                yield batch.entries()
            return
        horizon = min(c.batch.last for c in cursors)
        parts = []
        for c in cursors:
            cut = c.batch.after(horizon, c.pos)
            if cut > c.pos:
                parts.append((c, c.pos, cut))
        if len(parts) == 1:
            c, start, cut = parts[0]
            yield c.take(start, cut)
        else:
            yield _sorted(parts)
        for c, _, cut in parts:
            c.pos = cut
        cursors = [c for c in cursors if c.pos < c.batch.n or c.advance()]


class _Cursor:
    """A shard's place in `merge_batches`: its current batch, the next entry in it, and the
    entries made of its rows ``made_at:made_at + len(made)`` (`take`; `chunk` rows at most)."""

    __slots__ = ("batch", "chunk", "made", "made_at", "pos", "rank", "rest")

    def __init__(
        self, rank: int, rest: Iterator[EntryBatch], batch: EntryBatch, chunk: int
    ) -> None:
        self.rank, self.rest, self.batch, self.pos, self.chunk = rank, rest, batch, 0, chunk
        self.made: list[ArchivedEntry] = []
        self.made_at = 0

    def take(self, start: int, cut: int) -> list[ArchivedEntry]:
        """The entries of rows ``start:cut`` of the batch, made `chunk` rows at a time, each
        chunk once (rows are taken in order)."""
        out: list[ArchivedEntry] = []
        while start < cut:
            if not self.made_at <= start < self.made_at + len(self.made):
                self.made_at = start
                self.made = self.batch.entries(start, min(self.batch.n, start + self.chunk))
            end = min(cut, self.made_at + len(self.made))
            out += self.made[start - self.made_at : end - self.made_at]
            start = end
        return out

    def advance(self) -> bool:
        """Move on to the shard's next batch; False when it has none."""
        batch = next(self.rest, None)
        if batch is None:
            return False
        self.batch, self.pos, self.made, self.made_at = batch, 0, [], 0
        return True


def _sorted(parts: list[tuple[_Cursor, int, int]]) -> list[ArchivedEntry]:
    """The entries ``start:cut`` of each cursor's batch in entry-ID order, ties by rank."""
    entries: list[ArchivedEntry] = []
    ms, seq, rank = [], [], []
    for c, start, cut in parts:
        n = cut - start
        entries += c.take(start, cut)
        ms.append(c.batch.ms.slice(start, n))
        seq.append(c.batch.seq.slice(start, n))
        rank.append(pa.repeat(c.rank, n).cast(pa.int32()))
    keys = pa.table(
        {"ms": pa.concat_arrays(ms), "seq": pa.concat_arrays(seq), "rank": pa.concat_arrays(rank)}
    )
    order = pc.sort_indices(
        keys, sort_keys=[("ms", "ascending"), ("seq", "ascending"), ("rank", "ascending")]
    )
    return list(map(entries.__getitem__, order.to_pylist()))
