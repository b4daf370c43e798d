"""`BoundedWSGIServer`: the WSGI server of the metrics and health port, with a deadline on every
read and write and a bounded number of connections (so of threads).

wsgiref's threading server (what prometheus-client's ``start_http_server`` uses too) gives each
accepted connection a thread and no socket timeout: a peer that connects and sends nothing holds
a thread for ever, and on ``0.0.0.0`` any peer can pile them up. Here:

* every socket read and write of a connection has a deadline of ``idle_timeout_s`` seconds: a
  connection that sends no request (or stops reading its response) is closed after it;
* at most ``max_connections`` connections are open at once, each with one thread. A connection
  beyond that evicts the oldest open connection that has not sent its request yet (an idle
  one), so idle sockets cannot lock a probe out; when every connection is busy answering a
  request, the new one waits up to a second for one to finish, then is closed unanswered
  (logged at WARNING at most once a minute).

wsgiref answers one request per connection (HTTP/1.0 semantics), so a connection is idle only
until its request has been read.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 10.0
"""Default deadline (seconds) of each read and write on a connection of the metrics port."""
MAX_CONNECTIONS = 16
"""Default limit of open connections (each with its thread) on the metrics port."""
_BUSY_WAIT_S = 1.0  # with every connection busy, how long a new one waits for a slot
_WARN_EVERY_S = 60.0


class _Handler(WSGIRequestHandler):
    """wsgiref's handler with the server's socket deadline, no access log, and a connection that
    times out or is closed under it ended quietly (DEBUG) instead of with a traceback."""

    server: BoundedWSGIServer

    def setup(self) -> None:
        self.request.settimeout(self.server.idle_timeout_s)  # each recv and send
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the request line's headers
        self.server.request_read(self.connection)  # no longer idle: not to be evicted
        return parsed

    def handle(self) -> None:
        try:
            super().handle()
        except OSError as exc:  # TimeoutError included: the peer was too slow, or evicted
            log.debug("metrics connection from %s ended: %r", self.client_address[0], exc)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds
        pass


class BoundedWSGIServer(WSGIServer):
    """A WSGI server with one thread per connection, at most `max_connections` of them, and a
    deadline of `idle_timeout_s` seconds on every socket read and write (see the module
    docstring). Raises `ValueError` for a non-positive limit or deadline, `OSError` when the
    address cannot be bound. Serve with ``serve_forever()``, stop with ``shutdown()``."""

    request_queue_size = 64  # listen backlog: peers wait there while an eviction completes

    def __init__(
        self,
        address: tuple[str, int],
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 seconds, got {idle_timeout_s!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._slots = threading.Semaphore(max_connections)
        self._lock = threading.Lock()
        self._idle: dict[socket.socket, None] = {}  # accepted, request not read yet; oldest first
        self._refused = 0
        self._warned = -_WARN_EVERY_S
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Runs in the serving thread: take a connection slot (evicting the oldest idle
        connection when there is none) and handle the connection in a thread of its own."""
        if not self._slots.acquire(blocking=False):
            with self._lock:
                oldest = next(iter(self._idle), None)
            wait_s = _BUSY_WAIT_S
            if oldest is not None:
                _end(oldest)  # its thread's read returns: it ends and frees its slot
                wait_s = self.idle_timeout_s  # at once; by its own deadline at the latest
            if not self._slots.acquire(timeout=wait_s):
                self._refuse(request)
                return
        with self._lock:
            self._idle[request] = None
        thread = threading.Thread(
            target=self._handle_connection,
            args=(request, client_address),
            name="eventbus-metrics-connection",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self._close(request)
            raise

    def request_read(self, request: socket.socket) -> None:
        """The request of `request` has been read: it is busy, no longer idle."""
        with self._lock:
            self._idle.pop(request, None)

    def _handle_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._close(request)

    def _close(self, request: Any) -> None:
        with self._lock:
            self._idle.pop(request, None)
        self.shutdown_request(request)
        self._slots.release()

    def _refuse(self, request: Any) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning(
                "metrics port: %d connection(s) closed unanswered, all %d connections busy",
                self._refused,
                self.max_connections,
            )
            self._refused = 0
        self.shutdown_request(request)


def _end(sock: socket.socket) -> None:
    """Shut `sock` down for both directions: a thread blocked reading it reads end of file."""
    with contextlib.suppress(OSError):  # already closed by its own thread
        sock.shutdown(socket.SHUT_RDWR)
