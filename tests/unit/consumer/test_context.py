"""`RetryPolicy` and `HandlerCall` (`eventbus.consumer.context`): no Redis."""

from __future__ import annotations

import functools
import threading
import uuid
from typing import Any

import pytest

from eventbus.consumer.context import Context, HandlerCall, RetryPolicy
from eventbus.errors import ConfigError

pytestmark = pytest.mark.anyio


def ctx(**overrides: object) -> Context:
    values: dict[str, object] = {
        "topic": "orders",
        "group": "billing",
        "shard": 1,
        "entry_id": "1-0",
        "resource_id": "o-1",
        "event_id_bytes": uuid.UUID(int=7).bytes,
        "event_type": "Tick",
        "published_at_ms": 0,
        "headers": {},
        "attempt": 1,
        "fencing_token": 3,
        "consumer_id": "c-1",
    }
    values.update(overrides)
    return Context(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 8])
def test_retry_delay_is_equal_jitter_of_the_capped_exponential(attempt: int) -> None:
    policy = RetryPolicy(max_attempts=10, base_s=0.1, max_s=0.5)
    ceiling = min(0.5, 0.1 * 2 ** (attempt - 1))
    delays = [policy.delay_s(attempt) for _ in range(300)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays), (min(delays), max(delays))
    assert max(delays) - min(delays) > ceiling / 10  # jittered, not a constant


def test_retry_delay_never_exceeds_the_cap() -> None:
    policy = RetryPolicy(max_attempts=100, base_s=1.0, max_s=2.0)
    assert max(policy.delay_s(a) for a in range(1, 80)) <= 2.0


def test_context_event_id_is_the_uuid_of_its_bytes() -> None:
    assert ctx().event_id == uuid.UUID(int=7)


async def test_async_handler_is_awaited_on_the_event_loop_with_context() -> None:
    seen: list[tuple[object, Context, bool]] = []

    async def handle(event: object, c: Context) -> None:
        seen.append((event, c, threading.current_thread() is threading.main_thread()))

    call = HandlerCall(handle, takes_context=True)
    assert call.is_async and call.name.endswith("handle")
    c = ctx()
    await call("e", c)
    assert seen == [("e", c, True)]


async def test_sync_handler_runs_in_a_worker_thread_without_context() -> None:
    seen: list[tuple[object, bool]] = []

    def handle(event: object) -> None:
        seen.append((event, threading.current_thread() is threading.main_thread()))

    call = HandlerCall(handle, takes_context=False)
    assert not call.is_async
    await call("e", ctx())
    assert seen == [("e", False)]


async def test_sync_or_async_is_decided_once_at_construction() -> None:
    """Swapping the function afterwards does not change how it is called: the decision is
    made once (the sync function stored as async runs on the event loop's thread, not in a
    worker thread)."""
    calls: list[int] = []

    async def handle(event: object) -> None:
        calls.append(0)

    call = HandlerCall(handle, takes_context=False)
    assert call.is_async

    def sync(event: object) -> None:
        calls.append(threading.get_ident())

    call.func = sync
    await call("e", ctx())
    assert calls == [threading.get_ident()]


async def test_handler_errors_propagate_from_both_kinds() -> None:
    async def a(event: object) -> None:
        raise ValueError("async boom")

    def s(event: object) -> None:
        raise KeyError("sync boom")

    with pytest.raises(ValueError, match="async boom"):
        await HandlerCall(a, takes_context=False)("e", ctx())
    with pytest.raises(KeyError, match="sync boom"):
        await HandlerCall(s, takes_context=False)("e", ctx())


def test_name_falls_back_to_repr_for_callables_without_a_qualname() -> None:
    class Callable_:
        def __call__(self, event: object) -> None: ...

        def __repr__(self) -> str:
            return "<my handler>"

    call = HandlerCall(Callable_(), takes_context=False)
    assert call.name == "<my handler>" and not call.is_async


def test_generators_and_keyword_only_parameters_are_refused_at_registration() -> None:
    """An ``async def`` generator, and a handler whose event is a keyword-only
    parameter, registered and then failed every delivery."""

    async def agen(event: object) -> Any:
        yield event

    def gen(event: object) -> Any:
        yield event

    async def kw_event(*, event: object) -> None: ...

    async def kw_ctx(event: object, *, ctx: object) -> None: ...

    for handler, takes_ctx in ((agen, False), (gen, False), (kw_event, False), (kw_ctx, True)):
        with pytest.raises(ConfigError, match=r"generator|keyword-only"):
            HandlerCall(handler, takes_context=takes_ctx)
    HandlerCall(kw_ctx, takes_context=False)  # a keyword-only third party: not ours to pass


async def test_an_awaitable_returned_by_a_sync_function_is_awaited() -> None:
    ran: list[str] = []

    async def inner(event: object) -> str:
        ran.append("inner")
        return "reply"

    @functools.wraps(inner)
    def wrapper(event: object) -> Any:
        return inner(event)

    call = HandlerCall(wrapper, takes_context=False)
    assert await call("e", ctx()) == "reply" and ran == ["inner"]
