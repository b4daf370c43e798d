"""The shared publishing cases on the in-memory bus (`eventbus.testing.memory_redis`, fakeredis
with Lua); see `tests/cases`."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.publish_cases import PublishCases


class TestPublishInMemory(MemoryBackend, PublishCases):
    pass
