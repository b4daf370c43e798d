"""The shared publishing cases on the session's redis-server; see `tests/cases`."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.publish_cases import PublishCases


class TestPublishOnRedis(RedisBackend, PublishCases):
    pass
