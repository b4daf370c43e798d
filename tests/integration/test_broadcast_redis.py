"""The broadcast cases on a real redis-server (`cases.broadcast_cases`)."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.broadcast_cases import BroadcastCases


class TestBroadcastOnRedis(RedisBackend, BroadcastCases):
    pass
