"""The verifiable-reply cases on the in-memory bus (`cases.request_reply_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import MemoryBackend
from cases.request_reply_cases import RequestReplyCases

pytestmark = pytest.mark.anyio


class TestRequestReplyInMemory(MemoryBackend, RequestReplyCases):
    pass
