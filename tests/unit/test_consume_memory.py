"""The shared consume and failure-policy cases on the in-memory bus users test with
(`eventbus.testing.memory_redis`, fakeredis with Lua); see `tests/cases`."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.consume_cases import ConsumeCases
from cases.failure_policy_cases import FailurePolicyCases


class TestConsumeInMemory(MemoryBackend, ConsumeCases):
    pass


class TestFailurePolicyInMemory(MemoryBackend, FailurePolicyCases):
    pass
