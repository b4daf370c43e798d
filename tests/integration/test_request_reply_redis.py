"""The verifiable-reply cases on a real redis-server, single node and cluster
(`cases.request_reply_cases`)."""

from __future__ import annotations

import pytest
from cases.backends import RedisBackend
from cases.request_reply_cases import RequestReplyCases

pytestmark = pytest.mark.anyio


class TestRequestReplyOnRedis(RedisBackend, RequestReplyCases):
    pass
