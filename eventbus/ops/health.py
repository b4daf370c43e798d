"""Health for Kubernetes probes, and the HTTP server of ``eventbus run --metrics-port``.

One port serves ``/metrics`` (Prometheus), ``/healthz`` (liveness) and ``/readyz`` (readiness),
each answering 200 or 503 with a one-line reason:

* **live**: the process's event loop is running: its health tick (every `TICK_S`) is younger than
  `STALL_S`. A loop blocked by a CPU-bound handler or a deadlock stops ticking; the HTTP server
  runs in a thread of its own, so it can say so.
* **ready**: every consumer holds a valid lease, i.e. its last liveness refresh (a lock round or
  a heartbeat) reached Redis within ``lease_s``: it is connected and holds shards or takes part in
  sharing them. Not ready before the first lock round, nor while Redis is unreachable.

With ``--processes N`` the parent serves the port: metrics of every process (prometheus-client's
multiprocess mode, files in ``PROMETHEUS_MULTIPROC_DIR``), live when every child runs and ticks,
ready when every child says it is (the gauges ``eventbus_loop_tick_timestamp_seconds`` and
``eventbus_ready``, which each child sets at every tick).

The port is safe to expose (``0.0.0.0`` for a kubelet or Prometheus on another host): every
read and write of a connection has a deadline and the connections (one thread each) are bounded,
idle ones giving way to new ones (`serve`, `eventbus.ops.http_server`).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import anyio
from prometheus_client import CollectorRegistry, make_wsgi_app

from eventbus.ops.http_server import IDLE_TIMEOUT_S, MAX_CONNECTIONS, BoundedWSGIServer
from eventbus.ops.metrics import METRICS

TICK_S = 1.0
"""Seconds between two health ticks of a running loop."""
STALL_S = 10.0
"""A loop whose last tick is older than this (seconds) is not live."""

Check = tuple[bool, str]


class Probe(Protocol):
    def live(self) -> Check: ...
    def ready(self) -> Check: ...


class Health:
    """The health of this process's running bus (`tick` must run on its event loop).

    :param consumers: the bus's running consumers, read at each check (``lambda:
        bus.consumers``): each has ``topic.name``, ``group`` and ``lease.ok()``
    :param stall_s: seconds without a tick after which the loop is not live
    """

    def __init__(self, consumers: Callable[[], Sequence[Any]], *, stall_s: float = STALL_S) -> None:
        self.consumers = consumers
        self.stall_s = stall_s
        self.last_tick = 0.0  # time.monotonic() of the last tick; 0: not started

    async def tick(self, interval_s: float = TICK_S) -> None:
        """Record a tick every `interval_s` seconds until cancelled (and set the gauges)."""
        while True:
            self.last_tick = time.monotonic()
            METRICS.loop_tick.set(time.time())
            METRICS.ready.set(1 if self.ready()[0] else 0)
            await anyio.sleep(interval_s)

    def live(self) -> Check:
        if not self.last_tick:
            return False, "event loop not started"
        age = time.monotonic() - self.last_tick
        if age > self.stall_s:
            return False, f"event loop blocked: no tick for {age:.1f} s"
        return True, "ok"

    def ready(self) -> Check:
        consumers = list(self.consumers())
        if not consumers:
            return False, "no consumer running yet"
        waiting = [f"{c.topic.name}/{c.group}" for c in consumers if not c.lease.ok()]
        if waiting:
            return False, "no valid lease (Redis unreachable, or starting): " + ", ".join(waiting)
        return True, "ok"


async def run_with_health(run: Callable[[], Awaitable[None]], health: Health) -> None:
    """``await run()`` (``bus.run(handle_signals=True)``) with `health.tick` running beside it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(health.tick)
        await run()
        tg.cancel_scope.cancel()


class ChildrenHealth:
    """The health of ``eventbus run --processes N``'s children, read by the parent from the
    children's multiprocess metric files (`registry` holds a ``MultiProcessCollector``, or the
    `eventbus.ops.children_metrics.ChildrenMetrics` of ``eventbus run``, which leaves out a file
    a child is still creating: that child's gauges are missing, so it is not live or ready)."""

    def __init__(
        self, procs: Sequence[Any], registry: CollectorRegistry, *, stall_s: float = STALL_S
    ) -> None:
        self.procs = procs  # subprocess.Popen objects
        self.registry = registry
        self.stall_s = stall_s

    def _gauge(self, name: str) -> dict[str, float] | str:
        """pid -> value of the liveall gauge `name`, or why the children's metric files could
        not be read: a child that is creating its file leaves it empty for a moment, and
        prometheus_client's reader then fails with ``struct.error`` (a 503, not a traceback)."""
        out: dict[str, float] = {}
        try:
            for family in self.registry.collect():
                for sample in family.samples:
                    if sample.name == name and "pid" in sample.labels:
                        out[sample.labels["pid"]] = sample.value
        except (struct.error, OSError) as exc:
            return f"the children's metric files could not be read ({exc}): a child is writing one"
        return out

    def _every_child(
        self, gauge: str, failing: Callable[[float | None], bool], failed: str
    ) -> Check:
        """Bad while a child has exited, the files cannot be read, or a child's value of
        `gauge` (None: it has none) is `failing`: then `failed` and the children's pids."""
        if dead := [str(p.pid) for p in self.procs if p.poll() is not None]:
            return False, f"child processes exited: {', '.join(dead)}"
        values = self._gauge(gauge)
        if isinstance(values, str):
            return False, values
        if bad := [str(p.pid) for p in self.procs if failing(values.get(str(p.pid)))]:
            return False, f"{failed} {', '.join(bad)}"
        return True, "ok"

    def live(self) -> Check:
        now = time.time()
        return self._every_child(
            "eventbus_loop_tick_timestamp_seconds",
            lambda tick: now - (tick or 0) > self.stall_s,
            "no recent tick from processes",
        )

    def ready(self) -> Check:
        return self._every_child("eventbus_ready", lambda ready: ready != 1, "processes not ready:")


def wsgi_app(probe: Probe, registry: CollectorRegistry | None = None) -> Callable[..., Any]:
    """``/healthz`` and ``/readyz`` from `probe`, everything else Prometheus's metrics app."""
    metrics = make_wsgi_app(registry) if registry is not None else make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/livez", "/readyz"):
            ok, reason = probe.ready() if path == "/readyz" else probe.live()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [reason.encode() + b"\n"]
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


def serve(
    host: str,
    port: int,
    probe: Probe,
    registry: CollectorRegistry | None = None,
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> BoundedWSGIServer:
    """Serve `wsgi_app` on `host`:`port` (0: a free port, see ``server.server_port``) from a
    daemon thread; returns the server (``shutdown()`` stops it).

    A connection must send its request, and read its response, with no read or write waiting
    longer than `idle_timeout_s` seconds (default 10), or it is closed; at most
    `max_connections` (default 16) are open at once, each with one thread, and a connection
    beyond them evicts the oldest one that has sent no request yet
    (`eventbus.ops.http_server.BoundedWSGIServer`). Raises `OSError` when the address is taken,
    `ValueError` for a non-positive `idle_timeout_s` or `max_connections`."""
    server = BoundedWSGIServer(
        (host, port), idle_timeout_s=idle_timeout_s, max_connections=max_connections
    )
    server.set_app(wsgi_app(probe, registry))
    threading.Thread(target=server.serve_forever, name="eventbus-metrics", daemon=True).start()
    return server
