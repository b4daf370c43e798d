"""Running a redis-py pipeline without losing the server's reason for an error reply.

When a pipeline raises its first error reply, redis-py (6.4 at least) replaces the exception's
message with a template it never fills in: "Command # 1 (XAUTOCLAIM ...) of pipeline caused
error: {exception.args}". The server's words (NOGROUP, NOPERM, OOM, WRONGTYPE...) are gone, and
with them what callers must tell apart (a missing group is recreated, a refusal is not). With
``raise_on_error=False`` the replies hold the exceptions as the parser made them; `execute`
raises the first of those instead.
"""

from __future__ import annotations

from typing import Any


async def execute(pipe: Any) -> list[Any]:
    """``await pipe.execute()``, raising the first error reply with the server's own message
    (connection errors propagate as redis-py raises them)."""
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
