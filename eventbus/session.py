"""What a bus holds while in use: `Session`, bound to one process and one event loop.

An `EventBus` is a declaration (settings, topics, subscribers) plus, while in use, a session:
its Redis client, topic registry and publisher, and, while entered (``async with bus:``), the
publisher's flusher. The bus makes its session on first use and drops it on leaving
``async with bus:`` (closing the client it made itself), so that the bus can be entered again,
from the same or another event loop. A session is also dropped, unclosed, when the bus is used
from another event loop than the one it was made on (its connections belong to that loop), or
in a forked child (they belong to the parent: `fork_count` tells).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from eventbus.locking.member import AsyncRedis
from eventbus.protocol.topics import TopicRegistry

_forks = 0


def _after_fork_in_child() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_count() -> int:
    """How many times this process's ancestors forked on the way to it (0 in the parent)."""
    return _forks


def current_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio event loop, or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass(eq=False)
class Session:
    """A bus's Redis client and what is built on it, for one process and one event loop.

    `owned`: the bus made the client (it closes it); otherwise it was given to it.
    `stack` is set while the bus is entered (its flusher's task group).
    """

    redis: AsyncRedis
    owned: bool
    registry: TopicRegistry
    loop: asyncio.AbstractEventLoop | None = field(default_factory=current_loop)
    thread: int = field(default_factory=threading.get_ident)  # where `loop` runs
    forks: int = field(default_factory=fork_count)
    pid: int = field(default_factory=os.getpid)
    publisher: Any = None  # eventbus.publishing.publisher.Publisher, made on first use
    stack: contextlib.AsyncExitStack | None = None

    @property
    def forked(self) -> bool:
        """Whether this process is a fork of the one that made the session."""
        return self.forks != _forks

    def other_loop(self) -> bool:
        """Whether the caller runs on another event loop than the session's (binding the
        session to the caller's loop when it was made outside any)."""
        loop = self.loop
        if loop is not None and self.thread == threading.get_ident() and loop.is_running():
            return False  # the one loop running on this thread: no get_running_loop per call
        loop = current_loop()
        if loop is None or loop is self.loop:
            return False
        if self.loop is None:
            self.loop, self.thread = loop, threading.get_ident()
            return False
        return True
