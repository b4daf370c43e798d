"""`EventBus` declarations: handler signatures, topics, subscriptions (no Redis needed)."""

from __future__ import annotations

from typing import Union

import pytest
from pydantic import BaseModel

from eventbus import ConfigError, Context, EventBus, Settings


class A(BaseModel):
    x: int


class B(BaseModel):
    y: str


class AlsoA(BaseModel):
    __event_type__ = "A"
    z: int


@pytest.fixture
def bus() -> EventBus:
    return EventBus(Settings(redis_url="redis://127.0.0.1:1/0", shards=8))


def test_async_handler_with_context(bus: EventBus) -> None:
    @bus.subscriber("orders", group="billing")
    async def handle(event: A, ctx: Context) -> None: ...

    (sub,) = bus.subscriptions
    assert sub.models == {"A": A}
    assert sub.call.takes_context and sub.call.is_async and sub.handler is handle
    assert (sub.topic.name, sub.topic.shards) == ("orders", 8)
    assert (sub.group, sub.ack) == ("billing", "after")


def test_sync_handler_without_context_and_union_of_models(bus: EventBus) -> None:
    @bus.subscriber("orders", group="audit", ack="before", max_attempts=2)
    def handle(event: A | B) -> None: ...

    (sub,) = bus.subscriptions
    assert sub.models == {"A": A, "B": B}
    assert not sub.call.takes_context and not sub.call.is_async
    assert (sub.ack, sub.retry.max_attempts) == ("before", 2)


def test_typing_union_is_accepted(bus: EventBus) -> None:
    @bus.subscriber("orders", group="g")
    async def handle(event: Union[A, B], ctx: Context) -> None: ...  # noqa: UP007

    assert set(bus.subscriptions[0].models) == {"A", "B"}


def _no_params() -> None: ...
def _three(event: A, ctx: Context, extra: int) -> None: ...
def _unannotated(event, ctx): ...  # type: ignore[no-untyped-def]
def _not_a_model(event: int) -> None: ...
def _model_or_none(event: A | None) -> None: ...
def _dict(event: dict) -> None: ...  # type: ignore[type-arg]
def _same_type_name(event: A | AlsoA) -> None: ...


@pytest.mark.parametrize(
    "handler",
    [_no_params, _three, _unannotated, _not_a_model, _model_or_none, _dict, _same_type_name],
)
def test_bad_handler_signatures_are_refused(bus: EventBus, handler: object) -> None:
    with pytest.raises(ConfigError):
        bus.subscriber("orders", group="g")(handler)  # type: ignore[type-var]
    assert bus.subscriptions == []


def test_one_handler_per_topic_and_group(bus: EventBus) -> None:
    async def first(event: A) -> None: ...
    async def second(event: B) -> None: ...

    bus.subscriber("orders", group="g")(first)
    with pytest.raises(ConfigError, match="already has a handler"):
        bus.subscriber("orders", group="g")(second)
    bus.subscriber("orders", group="other")(second)
    bus.subscriber("payments", group="g")(second)
    assert len(bus.subscriptions) == 3


@pytest.mark.parametrize("group", ["", "a:b", "with space", "{tag}"])
def test_invalid_group_names_are_refused(bus: EventBus, group: str) -> None:
    with pytest.raises(ConfigError):
        bus.subscriber("orders", group=group)


def test_invalid_topic_name_and_ack_mode(bus: EventBus) -> None:
    async def h(event: A) -> None: ...

    with pytest.raises(ConfigError):
        bus.subscriber("bad topic", group="g")(h)
    with pytest.raises(ConfigError):
        bus.subscriber("orders", group="g", ack="sometimes")  # type: ignore[arg-type]


def test_topic_declaration(bus: EventBus) -> None:
    t = bus.topic("orders", shards=32, maxlen=500)
    assert (t.shards, t.maxlen) == (32, 500)
    assert bus.topic("orders") is t
    assert bus.topic("orders", shards=32) is t
    with pytest.raises(ConfigError):
        bus.topic("orders", shards=16)
    with pytest.raises(ConfigError):
        bus.topic("orders", maxlen=7)
    assert bus.topic("other").shards == 8  # from the settings
    with pytest.raises(ConfigError):
        bus.topic("x", shards=0)


@pytest.mark.anyio
async def test_run_without_subscribers_is_refused(bus: EventBus) -> None:
    with pytest.raises(ConfigError, match="no subscribers"):
        await bus.run()


@pytest.mark.parametrize("bad", [{"shards": 0}, {"maxlen": 0}, {"maxlen": -5}, {"shards": 2048}])
def test_topic_refuses_explicit_bad_values(bus: EventBus, bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        bus.topic("x", **bad)


def test_unresolvable_annotation_is_a_config_error(bus: EventBus) -> None:
    # this module uses postponed annotations: a model local to a function cannot be resolved
    class Local(BaseModel):
        x: int

    async def handle(event: Local) -> None: ...

    with pytest.raises(ConfigError, match="module level"):
        bus.subscriber("orders", group="g")(handle)
