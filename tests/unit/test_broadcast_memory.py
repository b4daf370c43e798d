"""The broadcast cases on the in-memory bus (`cases.broadcast_cases`)."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.broadcast_cases import BroadcastCases


class TestBroadcastInMemory(MemoryBackend, BroadcastCases):
    pass
