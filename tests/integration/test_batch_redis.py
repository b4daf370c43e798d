"""The batch handler cases (`cases.batch_cases`) on a real redis-server."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.batch_cases import BatchCases


class TestBatchOnRedis(RedisBackend, BatchCases):
    pass
