"""The shared consume and failure-policy cases on a real redis-server; see `tests/cases`.
Cases only a real server can run are in `test_consume.py` and `test_failure_policy.py`."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.consume_cases import ConsumeCases
from cases.failure_policy_cases import FailurePolicyCases


class TestConsumeOnRedis(RedisBackend, ConsumeCases):
    pass


class TestFailurePolicyOnRedis(RedisBackend, FailurePolicyCases):
    pass
