"""The event-type routing cases on a real redis-server (`cases.routing_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import RedisBackend
from cases.routing_cases import RoutingCases

pytestmark = pytest.mark.anyio


class TestRoutingOnRedis(RedisBackend, RoutingCases):
    pass
