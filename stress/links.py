"""Per-client network links for topologies with more than one Redis address.

A Sentinel or Cluster client learns node addresses from the servers (``SENTINEL MASTERS``,
``CLUSTER SLOTS``, ``-MOVED``/``-ASK`` redirects) and would then connect to the nodes directly,
past its proxy. `ClientLinks` gives one client process one `proxy.Link` per server address
(every data node, every sentinel) and rewrites, in the replies that carry node addresses, each
node's port into the port of this client's own link to that node. So the client follows
failovers and redirects as usual, through links that a network fault can delay or cut as one
(`ClientLinks` has `Link`'s controls and applies them to all its links).

Rewritten (RESP2, what redis-py 6 speaks by default), only where a reply names a known node port:

* Sentinel links: a ``port`` field in ``SENTINEL MASTERS`` / ``REPLICAS`` replies
  (``$4 port $n <port>``);
* Cluster links: the port after the ``127.0.0.1`` of a node in ``CLUSTER SLOTS``
  (``$9 127.0.0.1 :<port>``), and ``-MOVED <slot> 127.0.0.1:<port>`` / ``-ASK ...`` errors.

Bytes that may be the start of such a pattern are held back until the pattern is complete or
cannot match any more (a reply always ends with CRLF, so nothing is held back for long).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from proxy import CHUNK, Link, ProxyHub


class Pattern:
    """A reply fragment naming a node port: where it starts, the regex of a complete one (group
    ``port``; the other groups are kept), and how many CRLFs a complete one contains."""

    def __init__(self, start: bytes, rx: bytes, crlfs: int, sized: bool = False) -> None:
        self.start, self.rx, self.crlfs = start, re.compile(rx), crlfs
        self.sized = sized  # the port is a bulk string: its length prefix changes with it


SENTINEL_PATTERNS = [
    Pattern(b"$4\r\nport\r\n", rb"(?P<a>\$4\r\nport\r\n\$)\d+\r\n(?P<port>\d+)(?P<b>\r\n)", 4,
            sized=True),
]  # fmt: skip
CLUSTER_PATTERNS = [
    Pattern(b"$9\r\n127.0.0.1\r\n", rb"(?P<a>\$9\r\n127\.0\.0\.1\r\n:)(?P<port>\d+)(?P<b>\r\n)", 3),
    Pattern(b"-MOVED ", rb"(?P<a>-MOVED \d+ 127\.0\.0\.1:)(?P<port>\d+)(?P<b>\r\n)", 1),
    Pattern(b"-ASK ", rb"(?P<a>-ASK \d+ 127\.0\.0\.1:)(?P<port>\d+)(?P<b>\r\n)", 1),
]  # fmt: skip


class PortRewriter:
    """Rewrites node ports in a byte stream of replies (see the module docstring)."""

    def __init__(self, ports: dict[int, int], patterns: list[Pattern]) -> None:
        self.ports = ports  # upstream port -> this client's link port (filled in as made)
        self.patterns = patterns

    def _rewrite(self, p: Pattern, m: re.Match[bytes]) -> bytes:
        port = self.ports.get(int(m["port"]))
        if port is None:
            return m[0]
        new = str(port).encode()
        size = str(len(new)).encode() + b"\r\n" if p.sized else b""
        return m["a"] + size + new + m["b"]

    def split(self, buf: bytes) -> tuple[bytes, bytes]:
        """(what can be sent now, rewritten; what must wait for more bytes)."""
        hold = len(buf)
        for p in self.patterns:
            i = buf.rfind(p.start)
            if i >= 0 and not p.rx.match(buf, i) and buf.count(b"\r\n", i) < p.crlfs:
                hold = min(hold, i)  # a match may still be under way
            for k in range(min(len(p.start) - 1, len(buf)), 0, -1):
                if buf.endswith(p.start[:k]):  # the pattern's start is cut: wait for the rest
                    hold = min(hold, len(buf) - k)
                    break
        out = buf[:hold]
        for p in self.patterns:
            if p.start in out:
                out = p.rx.sub(lambda m, p=p: self._rewrite(p, m), out)
        return out, buf[hold:]


class _RewritingReader:
    """A StreamReader stand-in whose ``read`` returns the upstream's bytes, rewritten."""

    def __init__(self, src: asyncio.StreamReader, rewriter: PortRewriter) -> None:
        self.src = src
        self.rewriter = rewriter
        self.held = b""
        self.eof = False

    async def read(self, n: int = CHUNK) -> bytes:
        while not self.eof:
            data = await self.src.read(n)
            if not data:
                self.eof = True
                break
            out, self.held = self.rewriter.split(self.held + data)
            if out:
                return out
        out, self.held = self.held, b""
        return out


class RewritingLink(Link):
    """A `Link` whose replies (the "down" direction) go through a `PortRewriter`."""

    rewriter: PortRewriter

    async def _pump(self, conn: Any, src: Any, dst: Any, d: Any) -> None:
        if d is self.down:
            src = _RewritingReader(src, self.rewriter)
        await super()._pump(conn, src, dst, d)


def _start(hub: ProxyHub, upstream: int, seed: int, rewriter: PortRewriter | None) -> Link:
    if rewriter is None:
        return hub.start(upstream, seed=seed)
    holder: dict[str, Link] = {}

    def make() -> None:
        link = RewritingLink(hub, upstream, seed)
        link.rewriter = rewriter
        holder["link"] = link

    hub.call(make)  # a Link's Event belongs to the hub loop's thread
    link = holder["link"]
    asyncio.run_coroutine_threadsafe(link._listen(), hub.loop).result(10)
    hub.links.append(link)
    return link


class ClientLinks:
    """One client process's links: one per upstream port, all faulted together."""

    def __init__(
        self, hub: ProxyHub, nodes: list[int], sentinels: list[int], cluster: bool, seed: int
    ) -> None:
        ports: dict[int, int] = {}
        node_rw = PortRewriter(ports, CLUSTER_PATTERNS) if cluster else None
        sentinel_rw = PortRewriter(ports, SENTINEL_PATTERNS)
        self.links: dict[int, Link] = {}
        for i, port in enumerate(nodes + sentinels):
            rw = node_rw if port in nodes else sentinel_rw
            self.links[port] = _start(hub, port, seed * 100 + i, rw)
            ports[port] = self.links[port].port

    def port(self, upstream: int) -> int:
        """This client's port for the server on `upstream`."""
        return self.links[upstream].port

    def _each(self, fn: Callable[[Link], None]) -> None:
        for link in self.links.values():
            fn(link)

    def set(self, **kw: Any) -> None:
        self._each(lambda link: link.set(**kw))

    def spike(self, **kw: Any) -> None:
        self._each(lambda link: link.spike(**kw))

    def blackhole(self) -> None:
        self._each(lambda link: link.blackhole())

    def heal(self, *, drop: bool = False) -> None:
        self._each(lambda link: link.heal(drop=drop))

    def clear(self) -> None:
        self._each(lambda link: link.clear())
