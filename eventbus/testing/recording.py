"""What a test sees of a running bus: the handler calls (`Handled`), handler failures
re-raised in fail-fast mode (`HandlerFailed`), and what is in Redis: published events
(`Published`) and dead letters.

`Watched` wraps a subscription's handler call for the length of a `eventbus.testing.running`
block: every call is recorded; with `fail_fast`, a handler's exception is recorded and the
entry acked as if handled (no retry, no backoff, no dead letter), to be re-raised by
`TestBus.drain` (or at the end of the block), so that a test fails with the handler's own
traceback instead of a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from eventbus.consumer.context import Context, HandlerCall
from eventbus.dlq import DeadLetter
from eventbus.errors import EventBusError
from eventbus.locking.member import AsyncRedis
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.keys import Keys

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Handled:
    """One handler call: `event` as the handler got it, its `ctx`, the handler's `name`, and
    the exception it raised (None when it returned)."""

    event: Any
    ctx: Context
    name: str
    error: BaseException | None = None


class HandlerFailed(EventBusError):
    """A handler raised in fail-fast mode; the handler's exception is its ``__cause__``."""


@dataclass(frozen=True, slots=True)
class Published:
    """An entry of a topic, decoded: `payload` is the plain payload (a dict for models)."""

    entry_id: str
    shard: int
    resource_id: str
    event_type: str
    payload: Any
    headers: dict[str, str]

    def as_(self, model: type[M]) -> M:
        """The payload validated as `model`."""
        return model.model_validate(self.payload)


class Watched(HandlerCall):
    """A handler call recorded into `log`; see the module docstring."""

    def __init__(self, inner: HandlerCall, log: list[Handled], *, fail_fast: bool) -> None:
        self.inner = inner
        self.log = log
        self.fail_fast = fail_fast
        self.func = inner.func
        self.takes_context = inner.takes_context
        self.is_async = inner.is_async
        self.name = inner.name

    async def __call__(self, event: Any, ctx: Context) -> Any:
        try:
            result = await self.inner(event, ctx)
        except Exception as exc:
            self.log.append(Handled(event, ctx, self._name(ctx), exc))
            if self.fail_fast:
                return None  # acked as handled; TestBus.drain raises it
            raise
        self.log.append(Handled(event, ctx, self._name(ctx)))
        return result

    def _name(self, ctx: Context) -> str:
        routes = getattr(self.inner, "routes", None)
        route = routes.get(ctx.event_type) if routes is not None else None
        return route.call.name if route is not None else self.name


def failure_of(log: list[Handled], reported: int) -> HandlerFailed | None:
    """A `HandlerFailed` for the first failed call in `log` after the first `reported`."""
    for h in log[reported:]:
        if h.error is not None:
            failed = HandlerFailed(
                f"handler {h.name} raised {h.error!r} on {h.ctx.event_type} entry "
                f"{h.ctx.entry_id} of resource {h.ctx.resource_id!r} (fail-fast: not retried, "
                "not dead-lettered; run with fail_fast=False for the subscriber's policy)"
            )
            failed.__cause__ = h.error
            return failed
    return None


async def published(redis: AsyncRedis, keys: Keys, topic: str, shards: int) -> list[Published]:
    """Every entry of `topic`'s shard streams, in entry-ID order (control entries included)."""
    out: list[tuple[EntryId, Published]] = []
    for shard in range(shards):
        for entry_id, fields in await redis.xrange(keys.stream(topic, shard)):
            env = decode_entry(fields)
            eid = entry_id.decode()
            out.append(
                (
                    parse_id(eid),
                    Published(
                        eid, shard, env.resource_id, env.event_type, env.payload, env.headers
                    ),
                )
            )
    return [p for _, p in sorted(out, key=lambda x: x[0])]


async def dead_letters(redis: AsyncRedis, keys: Keys, topic: str, group: str) -> list[DeadLetter]:
    """The dead letters of `group` on `topic`, oldest first."""
    rows = await redis.xrange(keys.dead_letter(topic, group))
    return [DeadLetter.parse(i, f) for i, f in rows]
