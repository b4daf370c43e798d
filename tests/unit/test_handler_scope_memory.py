"""The handler ergonomics cases on the in-memory bus (`cases.handler_scope_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import MemoryBackend
from cases.handler_scope_cases import HandlerScopeCases

pytestmark = pytest.mark.anyio


class TestHandlerScopeInMemory(MemoryBackend, HandlerScopeCases):
    pass
