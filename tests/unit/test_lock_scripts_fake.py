"""The lock scripts' logic and `LockClient` on fakeredis (with Lua); see `lock_script_cases`."""

from __future__ import annotations

from typing import Any

import pytest
from unit.lock_script_cases import LockClientCases, LockScriptCases


class TestLockScriptsOnFakeRedis(LockScriptCases):
    @pytest.fixture
    def client(self, fake_redis: Any) -> Any:
        return fake_redis


class TestLockClientOnFakeRedis(LockClientCases):
    @pytest.fixture
    def client(self, fake_redis: Any) -> Any:
        return fake_redis
