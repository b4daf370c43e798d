"""The handler ergonomics cases on a real redis-server (`cases.handler_scope_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import RedisBackend
from cases.handler_scope_cases import HandlerScopeCases

pytestmark = pytest.mark.anyio


class TestHandlerScopeOnRedis(RedisBackend, HandlerScopeCases):
    pass
