"""What a publisher does for a topic before its XADDs, rarely: once per dictionary refresh
(`dictionaries.REFRESH_S`), the shard-count check against the topic's registered count
(`TopicRegistry.ensure` once, then `TopicRegistry.verify`: ``HSETNX`` then ``HGET``, so a
registry Redis lost is written again, and a count registered meanwhile by another publisher is
a `ShardCountMismatch`), and a look for the topic's newer zstd dictionary. Both run under
the publish deadline (`Settings.publish_timeout_s`) and the pipelines' retry backoff, so a
Redis restart during the first publish of a topic is retried like a failed XADD.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import anyio
from redis.backoff import AbstractBackoff
from redis.exceptions import ResponseError

from eventbus.client.retry import LOST_REPLY, REDIS_ERRORS
from eventbus.config import Settings
from eventbus.errors import PublishError
from eventbus.protocol.dictionaries import REFRESH_S, Dictionaries
from eventbus.protocol.topics import TopicConfig, TopicRegistry

log = logging.getLogger("eventbus.publisher")


class TopicSetup:
    """The shard-count check and the dictionary refresh of the topics one publisher writes."""

    def __init__(
        self,
        registry: TopicRegistry,
        dictionaries: Dictionaries,
        settings: Settings,
        backoff: AbstractBackoff,
    ) -> None:
        """`backoff` spaces the retries of the shard-count check (the pipelines' own)."""
        self._registry = registry
        self._dictionaries = dictionaries
        self._settings = settings
        self._backoff = backoff
        self._locks: dict[str, anyio.Lock] = {}
        self._verified: dict[str, float] = {}  # topic -> when its registry entry was checked

    async def run(self, topic: TopicConfig) -> None:
        """The topic's shard-count check and current dictionary, when due, within
        `publish_timeout_s` seconds. Raises `ShardCountMismatch`, and `PublishError` when Redis
        did not answer in time or refused."""
        with self._deadline(topic):
            await self._check_topic(topic)
            await self._recheck_topic(topic)
            await self._refresh_dictionary(topic)

    async def _recheck_topic(self, topic: TopicConfig) -> None:
        """Every `dictionaries.REFRESH_S` seconds, the topic's registry entry again
        (`TopicRegistry.verify`): written again if Redis lost it, `ShardCountMismatch` if
        another count was registered meanwhile. Best effort like the dictionary refresh: a
        connection error leaves it to the next refresh (the XADD reports the outage)."""
        now = time.monotonic()
        last = self._verified.setdefault(topic.name, now)  # the first check just happened
        if now - last < REFRESH_S:
            return
        self._verified[topic.name] = now
        try:
            await self._registry.verify(topic)
        except LOST_REPLY as exc:
            log.warning(
                "topic %s: registry not checked again (%s: %s)", topic.name, type(exc).__name__, exc
            )
        except ResponseError as exc:  # READONLY, OOM, NOPERM: as the first check
            raise PublishError(
                f"shard count of topic {topic.name!r} could not be checked: {exc}"
            ) from exc

    async def _refresh_dictionary(self, topic: TopicConfig) -> None:
        """Look for the topic's newer current dictionary, when due; best effort: after a
        connection error (Redis restarting) the cached one stays in use until the next refresh
        (`dictionaries.REFRESH_S` later; the XADD retries on its own); any other Redis error is a
        `PublishError`."""
        if not self._dictionaries.due(topic.name):
            return
        try:
            await self._dictionaries.current(topic.name)
        except LOST_REPLY as exc:
            log.warning(
                "topic %s: zstd dictionary not refreshed (%s: %s); keeping the cached one",
                topic.name,
                type(exc).__name__,
                exc,
            )
        except REDIS_ERRORS as exc:
            raise PublishError(
                f"topic {topic.name!r}: reading its zstd dictionary failed: {exc}"
            ) from exc

    async def _check_topic(self, topic: TopicConfig) -> None:
        """`TopicRegistry.ensure` under the publish retry policy: connection errors (a Redis
        restart) are retried until `publish_timeout_s`, then raised as `PublishError`, like those
        of the XADDs. Concurrent first publishes of a topic share one check."""
        if self._registry.checked(topic.name):
            return
        async with self._locks.setdefault(topic.name, anyio.Lock()):
            deadline = time.monotonic() + self._settings.publish_timeout_s
            failures = 0
            while not self._registry.checked(topic.name):
                try:
                    await self._registry.ensure(topic)
                except LOST_REPLY as exc:
                    failures += 1
                    delay = self._backoff.compute(failures)
                    if time.monotonic() + delay > deadline:
                        raise PublishError(
                            f"shard count of topic {topic.name!r} not checked within "
                            f"{self._settings.publish_timeout_s} s: {exc}"
                        ) from exc
                    log.warning(
                        "shard count check of topic %s failed (%s); retry in %.2f s",
                        topic.name,
                        exc,
                        delay,
                    )
                    await anyio.sleep(delay)
                except ResponseError as exc:  # READONLY (a replica), OOM, ...: not retried
                    raise PublishError(
                        f"shard count of topic {topic.name!r} could not be checked: {exc}"
                    ) from exc

    @contextlib.contextmanager
    def _deadline(self, topic: TopicConfig) -> Iterator[None]:
        """Cancel the body after `publish_timeout_s` seconds and raise `PublishError` then."""
        timeout = self._settings.publish_timeout_s
        with anyio.move_on_after(timeout) as scope:
            yield
        if scope.cancelled_caught:
            raise PublishError(
                f"publish to topic {topic.name!r} not confirmed within {timeout:g} s "
                "(EVENTBUS_PUBLISH_TIMEOUT_S): Redis did not answer in time; the event may or "
                "may not be stored (its event ID tells duplicates apart)"
            )
