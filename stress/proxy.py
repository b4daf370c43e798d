"""A fault-injecting TCP proxy on loopback, between one client process and the run's Redis.

    hub = ProxyHub()                      # one asyncio loop in a daemon thread
    link = hub.start(redis_port)          # listens on 127.0.0.1:<link.port>
    link.set(up_ms=20, down_ms=20, down_bps=200_000)   # latency per direction, slow reads
    link.spike(up_ms=3000, for_s=1.0)     # requests sent in the next second land 3 s late
    link.blackhole(for_s=4.0)             # accept, forward nothing, keep connections open
    link.heal()                           # deliver what was held (or drop=True: close them)
    link.clear()                          # a plain pipe again
    hub.close()

Only loopback: the proxy listens on 127.0.0.1 and connects only to 127.0.0.1 (the private
redis-server of a chaos run). Each accepted connection gets its own upstream connection and two
pumps, one per direction ("up": client to Redis, "down": Redis to client). A pump reads as fast as
the sender writes (so the sender never blocks, as with a kernel buffer and bytes in flight) and
writes each chunk in order once it is due: its arrival time plus the direction's latency at
arrival (plus jitter), never before the chunk ahead of it, only while the link is not blackholed,
and no faster than the direction's bandwidth. A blackhole is a partition that TCP survives: the
connections stay open, no RST, nothing is forwarded; when it heals, the bytes held meanwhile are
delivered in order, late (a request the client gave up on still reaches Redis, as it would after
a real partition shorter than TCP's retransmission timeout). ``heal(drop=True)`` instead closes
every connection that was open during the blackhole, as a TCP connection that gave up would.

Controls may be called from any thread: they are handed to the loop's thread. The hub's thread
is a daemon and every task belongs to its loop, so nothing outlives the harness process.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

LOOPBACK = "127.0.0.1"
CHUNK = 65536


class _Direction:
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.rate_bps = 0.0  # bytes/s; 0: unlimited
        self.spike_s = 0.0  # extra latency for chunks that arrive before spike_until
        self.spike_until = 0.0

    def latency(self, now: float, rng: random.Random) -> float:
        extra = self.spike_s if now < self.spike_until else 0.0
        return self.delay_s + extra + (rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)


class _Conn:
    """One proxied connection: the client's and Redis's streams and the two pumps."""

    def __init__(self, link: Link, client: tuple[Any, Any], upstream: tuple[Any, Any]) -> None:
        self.link = link
        self.client_r, self.client_w = client
        self.up_r, self.up_w = upstream
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.client_gone = False

    def start(self) -> None:
        link = self.link
        self.tasks = [
            asyncio.ensure_future(link._pump(self, self.client_r, self.up_w, link.up)),
            asyncio.ensure_future(link._pump(self, self.up_r, self.client_w, link.down)),
        ]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in (self.client_w, self.up_w):
            with contextlib.suppress(Exception):
                w.close()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.link.conns.discard(self)


class Link:
    """One proxy: a listening port on 127.0.0.1 forwarding to 127.0.0.1:`upstream_port`."""

    def __init__(self, hub: ProxyHub, upstream_port: int, seed: int = 0) -> None:
        self.hub = hub
        self.upstream_port = upstream_port
        self.port = 0
        self.up, self.down = _Direction(), _Direction()
        self.conns: set[_Conn] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._holed: set[_Conn] = set()  # connections open during the current blackhole
        self._rng = random.Random(seed)
        self._server: asyncio.AbstractServer | None = None
        self.accepted = 0
        self.bytes_up = 0
        self.bytes_down = 0

    # -- controls (any thread) ----------------------------------------------------------------
    def set(
        self,
        *,
        up_ms: float = 0,
        down_ms: float = 0,
        jitter_ms: float = 0,
        down_bps: float = 0,
        up_bps: float = 0,
    ) -> None:
        """Latency per direction (ms, plus up to `jitter_ms`), bandwidth per direction (bytes/s,
        0: unlimited; `down_bps` throttles what the client reads: slow reads)."""

        def apply() -> None:
            self.up.delay_s, self.down.delay_s = up_ms / 1000, down_ms / 1000
            self.up.jitter_s = self.down.jitter_s = jitter_ms / 1000
            self.up.rate_bps, self.down.rate_bps = up_bps, down_bps

        self.hub.call(apply)

    def spike(self, *, up_ms: float = 0, down_ms: float = 0, for_s: float) -> None:
        """Bytes arriving in the next `for_s` seconds get this much extra latency."""

        def apply() -> None:
            until = time.monotonic() + for_s
            self.up.spike_s, self.up.spike_until = up_ms / 1000, until
            self.down.spike_s, self.down.spike_until = down_ms / 1000, until

        self.hub.call(apply)

    def blackhole(self) -> None:
        """Forward nothing from now on (connections are still accepted and kept open)."""

        def apply() -> None:
            self._open.clear()
            self._holed = set(self.conns)

        self.hub.call(apply)

    def heal(self, *, drop: bool = False) -> None:
        """End a blackhole: deliver what was held, or (`drop`) close the connections that were
        open during it and forward again for new ones."""

        def apply() -> None:
            if drop:
                for c in list(self._holed | self.conns):
                    c.close()
            self._holed = set()
            self._open.set()

        self.hub.call(apply)

    def clear(self) -> None:
        """No latency, no throttling, no blackhole (held bytes are delivered)."""
        self.set()
        self.spike(for_s=0)
        self.heal()

    def stats(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "open": len(self.conns),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
        }

    # -- the loop's side ----------------------------------------------------------------------
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            upstream = await asyncio.wait_for(
                asyncio.open_connection(LOOPBACK, self.upstream_port), timeout=5
            )
        except (TimeoutError, OSError):  # Redis is restarting: the client sees EOF
            writer.close()
            return
        conn = _Conn(self, (reader, writer), upstream)
        self.conns.add(conn)
        if not self._open.is_set():
            self._holed.add(conn)
        conn.start()

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, d: _Direction
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await src.read(CHUNK):
                    now = time.monotonic()
                    queue.put_nowait((now + d.latency(now, self._rng), data))
            except (OSError, asyncio.IncompleteReadError):
                pass
            queue.put_nowait(None)  # EOF: after everything read before it

        reader = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                while True:  # due, and not blackholed (a blackhole may start while waiting)
                    if (wait := due - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                    if not self._open.is_set():
                        await self._open.wait()
                        continue
                    break
                if conn.closed:
                    return
                step = max(512, int(d.rate_bps / 50)) if d.rate_bps else len(data)
                for i in range(0, len(data), step):
                    piece = data[i : i + step]
                    if conn.client_gone and d is self.down:
                        break  # replies to a client that left: dropped, as by its kernel
                    try:
                        dst.write(piece)
                        await dst.drain()
                    except (OSError, ConnectionError):
                        if d is self.up:
                            raise
                        conn.client_gone = True  # the up pump still delivers what it holds
                        break
                    if d is self.up:
                        self.bytes_up += len(piece)
                    else:
                        self.bytes_down += len(piece)
                    if d.rate_bps:
                        await asyncio.sleep(len(piece) / d.rate_bps)
            # the sender closed: pass the close on once its bytes are delivered
            conn.close()
        except (OSError, ConnectionError):
            conn.close()
        finally:
            reader.cancel()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            c.close()


class ProxyHub:
    """An asyncio loop in a daemon thread that runs any number of `Link`s."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.links: list[Link] = []
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop's thread, and wait until it ran."""
        if threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        if not done.wait(10):
            raise RuntimeError("the proxy loop did not answer within 10 s")

    def start(self, upstream_port: int, seed: int = 0) -> Link:
        """A new proxy to 127.0.0.1:`upstream_port`, listening on 127.0.0.1 (`link.port`)."""
        holder: dict[str, Link] = {}

        def make() -> None:
            holder["link"] = Link(self, upstream_port, seed)

        self.call(make)  # the Event of a Link belongs to the loop's thread
        link = holder["link"]
        asyncio.run_coroutine_threadsafe(link._listen(), self.loop).result(10)
        self.links.append(link)
        return link

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def shutdown() -> None:
            for link in self.links:
                await link._close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
