"""Start a private ``redis-server`` on a free loopback port (a Cluster: `localredis.cluster`;
a Sentinel topology: `localredis.sentinel`).

Used by ``python -m examples.flights`` when no ``REDIS_URL`` is set, by the test fixtures and by the
benchmarks. Needs the ``redis-server`` binary (Debian package ``redis-server``) on PATH.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from eventbus.errors import EventBusError


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux ``ip_local_port_range``): the
    ports from there on are the ones `connect()` hands to client sockets."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int) -> bool:
    """Whether 127.0.0.1:`port` can be bound right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(below: int | None = None) -> int:
    """A TCP port on 127.0.0.1, free a moment ago, under `below` (default: the start of the
    kernel's ephemeral range).

    Below that range no client socket can take the port as its local port between this choice
    and a server's start, or while a server is down for a restart on the same port: a
    connected socket's port cannot be bound by a listener ("Address already in use"). Where
    the range leaves under 1,000 ports below it, the kernel picks (`bind` to port 0)."""
    top = min(below or 65536, ephemeral_low())
    while True:
        if top > 2024:
            port = random.randrange(1024, top)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port >= (below or 65536):
                continue
        if bindable(port):
            return port


def redis_binary(name: str = "redis-server") -> str:
    """Path of `name`; raises `EventBusError` saying how to install it when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise EventBusError(
            f"{name} not found on PATH: install it (Debian: apt-get install redis-server) "
            "or set REDIS_URL to an existing server"
        )
    return path


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1; a context manager.

    `appendonly` turns AOF on with the given ``appendfsync`` policy ("always", "everysec");
    `extra` adds raw ``--option value`` arguments. Data lives in a temporary folder unless `dir`
    is given. `restart()` stops and starts it on the same port and folder (AOF reload).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: str | None = None,
        dir: str | Path | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self._tmp = None if dir else tempfile.TemporaryDirectory(prefix="eventbus-redis-")
        self.dir = Path(dir) if dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--protected-mode",
            "no",
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", self.appendonly]
        return args + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until it answers PING; raises `EventBusError` if it does not (or if
        the binary is missing)."""
        args = self.args()  # raises before anything is opened when the binary is missing
        with open(self.dir / "redis.log", "ab") as log:  # the child keeps its own descriptor
            # its own session: a Ctrl-C meant for us must not stop Redis before we shut down
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise EventBusError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self, kill: bool = False) -> None:
        """Stop it (SIGTERM, or SIGKILL with `kill`) and wait for the process to end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            if self._tmp is not None:
                self._tmp.cleanup()
            raise

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
