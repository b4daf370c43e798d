"""The Verse profile's lock client beside a Verse consumer, on fakeredis; see
`verse_lock_cases`."""

from __future__ import annotations

from typing import Any

import pytest
from unit.verse_lock_cases import VerseLockCases

pytestmark = pytest.mark.anyio


class TestVerseLocksOnFakeRedis(VerseLockCases):
    @pytest.fixture
    def client(self, fake_redis: Any) -> Any:
        return fake_redis
