"""The event-type routing cases on the in-memory bus (`cases.routing_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import MemoryBackend
from cases.routing_cases import RoutingCases

pytestmark = pytest.mark.anyio


class TestRoutingInMemory(MemoryBackend, RoutingCases):
    pass
