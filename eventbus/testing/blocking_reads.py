"""Blocking reads on the in-memory Redis that block, as Redis's do.

fakeredis 2.40 answers ``XREADGROUP ... COUNT n BLOCK ms ... >`` at once, empty, when no entry
is there, instead of waiting up to `ms` for one (it waits only without ``COUNT``). The consumers
always read with ``COUNT``, so on the in-memory server each of them asked again and again: 5
idle subscribers made ~730 reads a second and took ~70 % of a core, which a test's own handlers
then had to share. `blocking_reads_connection` gives `eventbus.testing.memory_redis` connections
whose server side waits, as Redis does, until an entry arrives for the read (fakeredis wakes
blocked clients at every write), the BLOCK runs out, or ``CLIENT UNBLOCK`` ends it. A read that
has something to answer (entries, or a group's own pending entries: an ID other than ``>``)
answers at once, as before.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def blocking_reads_connection() -> type[Any]:
    """A fakeredis asyncio connection class whose socket blocks empty ``XREADGROUP`` reads
    (see the module docstring); the same class at every call. On a fakeredis whose socket is
    not where 2.x keeps it, fakeredis's own connection class (reads as fakeredis answers them:
    correct, only busier)."""
    from fakeredis import FakeAsyncRedisConnection

    try:  # the socket class fakeredis 2.x connects with (not public API)
        from fakeredis._socket import AsyncFakeSocket
    except ImportError:
        return FakeAsyncRedisConnection
    if not hasattr(AsyncFakeSocket, "_xreadgroup"):
        return FakeAsyncRedisConnection

    class BlockingReadsSocket(AsyncFakeSocket):
        def _xreadgroup(self, *args: Any, **kwargs: Any) -> Any:
            # None keeps a blocking read waiting (fakeredis's `_blocking`); an empty answer
            # ended it
            return super()._xreadgroup(*args, **kwargs) or None

    class BlockingReadsConnection(FakeAsyncRedisConnection):
        async def _connect(self) -> None:
            await super()._connect()
            if self._sock is not None and type(self._sock) is AsyncFakeSocket:
                self._sock.__class__ = BlockingReadsSocket  # adds no state: a new class only

    return BlockingReadsConnection
