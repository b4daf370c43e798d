"""A consumer process's lock and lease timeline, for explaining a failed check (chaos.py).

`install(path)` wraps, in this process only, the library calls that decide what a consumer may
do: lock rounds, heartbeats and releases (`LockClient`), lease renewals (`Lease.renew`) and
forgetting every shard (`Consumer.drop_all`). Each writes one tab-separated line to `path`, with
wall-clock ``time.time_ns()`` so that lines of every process share the ledgers' time axis:

* ``lock  <sent ns>  <reply ns>  <shard:token:state,...>`` a lock round's reply, or
  ``lock  <sent ns>  <failed ns>  !<error>``
* ``beat  <sent ns>  <reply ns>  <was live 1|0>``          a heartbeat (``!<error>`` if it failed)
* ``free  <sent ns>  <reply ns>  <shards released>``       a release
* ``lease <ns>  <lease end ns>``                           a renewal (the end as wall clock)
* ``drop  <ns>  <reason>``                                 every held shard forgotten

The wrappers only record: they call the wrapped method and return or raise what it does. One
``write(2)`` per line (ledger.LineWriter), so a SIGKILL loses at most the line being written.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from ledger import LineWriter

from eventbus.consumer.engine import Consumer
from eventbus.locking.lease import Lease
from eventbus.locking.locks import LockClient


def _wall(monotonic: float) -> int:
    """The wall-clock ns of an earlier `time.monotonic()` instant."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


def install(path: Path) -> None:
    out = LineWriter(path)

    def timed(kind: str, describe: Any) -> Any:
        def wrap(method: Any) -> Any:
            @functools.wraps(method)
            async def call(*args: Any, **kwargs: Any) -> Any:
                sent = time.time_ns()
                try:
                    result = await method(*args, **kwargs)
                except Exception as exc:
                    out.write(kind, sent, time.time_ns(), f"!{type(exc).__name__}: {exc}"[:200])
                    raise
                out.write(kind, sent, time.time_ns(), describe(result))
                return result

            return call

        return wrap

    def grants(reply: Any) -> str:
        return ",".join(f"{g.shard}:{g.token}:{int(g.state)}" for g in reply.grants.values())

    # what is absent (the library's internals changed) is not traced
    for name, kind, describe in (
        ("acquire", "lock", grants),
        ("heartbeat", "beat", int),
        ("release", "free", lambda r: ",".join(map(str, r))),
    ):
        if hasattr(LockClient, name):
            setattr(LockClient, name, timed(kind, describe)(getattr(LockClient, name)))

    renew = getattr(Lease, "renew", None)
    if renew is not None:

        def renewed(self: Lease, sent_at: float) -> None:
            renew(self, sent_at)
            out.write("lease", time.time_ns(), _wall(self.until))

        Lease.renew = renewed  # type: ignore[method-assign]

    drop_all = getattr(Consumer, "drop_all", None)
    if drop_all is not None:

        def dropped(self: Consumer, reason: str, **kwargs: Any) -> None:
            out.write("drop", time.time_ns(), reason[:200].replace("\t", " ").replace("\n", " "))
            drop_all(self, reason, **kwargs)

        Consumer.drop_all = dropped  # type: ignore[method-assign]


def read(path: Path) -> list[list[str]]:
    """The lines of a trace file, split (a torn last line left out)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8", errors="replace") as f:
        return [line[:-1].split("\t") for line in f if line.endswith("\n")]


def annotate(examples: list[dict[str, Any]], workdir: Path, t0_ns: int) -> None:
    """Add to each stale-token example (ledger.stale_token_starts) the trace lines of both
    consumers from 3 s before the stale run's start to 0.2 s after it, times in s since `t0_ns`:
    what each believed it held, and when, around the superseded start."""

    def since(field: str) -> str:
        return f"{(int(field) - t0_ns) / 1e9:.4f}" if field.isdigit() and len(field) > 15 else field

    for ex in examples:
        start = ex["run"]["start_ns"]
        ex["trace"] = {}
        for side in ("run", "after"):
            c = ex[side]["consumer"]
            ex["trace"][f"con-{c}"] = [
                " ".join(since(x) for x in line)
                for line in read(workdir / f"con-{c}.trace")
                if len(line) > 1 and start - 3e9 <= int(line[1]) <= start + 2e8
            ]
