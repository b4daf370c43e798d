"""De-duplication of handled events (``dedup_window_s``): a mark per event ID handled, kept for
the window, checked before the handler call (`Handling.step`). Marked only after a success, so a
failed attempt is retried, and an entry delivered twice (a publish retried after a lost reply,
a takeover) is handled once within the window."""

from __future__ import annotations

import math

from redis.asyncio.retry import Retry

from eventbus.client import retry as retrying
from eventbus.consumer.context import Subscription
from eventbus.locking.member import Member


class Dedup:
    """The marks of `sub`'s handled event IDs for `member`; `retry` retries their Redis calls.
    `window_s` is the window in whole seconds (0: no de-duplication)."""

    def __init__(self, member: Member, sub: Subscription, retry: Retry) -> None:
        window = sub.options.dedup_window_s
        self.window_s = math.ceil(window) if window else 0
        # whose window the marks are: the group's, shared by its members; a broadcast
        # subscription has no group (every instance handles every event, `_broadcast` is only
        # its name), so each instance keeps its own (`_broadcast[.<group>]@<consumer id>`)
        self.owner = f"{sub.group}@{member.consumer_id}" if sub.options.broadcast else sub.group
        self.redis, self.keys, self.topic, self.retry = member.redis, member.keys, sub.topic, retry

    async def seen(self, event_id: bytes) -> bool:
        """Whether `event_id` was handled within the window."""
        key = self.keys.dedup(self.topic.name, self.owner, event_id)
        return bool(await retrying.call(self.retry, "dedup check", lambda: self.redis.exists(key)))

    async def mark(self, event_id: bytes) -> None:
        """Mark `event_id` handled, for the window."""
        key = self.keys.dedup(self.topic.name, self.owner, event_id)
        await retrying.call(
            self.retry, "dedup mark", lambda: self.redis.set(key, b"1", ex=self.window_s)
        )
