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
    assert (sub.group, sub.options.ack) == ("billing", "after")


def test_sync_handler_without_context_and_union_of_models(bus: EventBus) -> None:
    @bus.subscriber("orders", group="audit", ack="before", max_attempts=2)
    def handle(event: A | B) -> None: ...

    (sub,) = bus.subscriptions
    assert sub.models == {"A": A, "B": B}
    assert not sub.call.takes_context and not sub.call.is_async
    assert (sub.options.ack, sub.options.retry.max_attempts) == ("before", 2)


def test_typing_union_is_accepted(bus: EventBus) -> None:
    @bus.subscriber("orders", group="g")
    async def handle(event: Union[A, B], ctx: Context) -> None: ...  # noqa: UP007

    assert set(bus.subscriptions[0].models) == {"A", "B"}


def _no_params() -> None: ...
def _three(event: A, ctx: Context, extra: int) -> None: ...
def _unannotated(event, ctx): ...  # type: ignore[no-untyped-def]
def _not_a_model(event: int) -> None: ...
def _model_or_none(event: A | None) -> None: ...
def _list(event: list) -> None: ...  # type: ignore[type-arg]
def _same_type_name(event: A | AlsoA) -> None: ...


@pytest.mark.parametrize(
    "handler",
    [_no_params, _three, _unannotated, _not_a_model, _model_or_none, _list, _same_type_name],
)
def test_bad_handler_signatures_are_refused(bus: EventBus, handler: object) -> None:
    with pytest.raises(ConfigError):
        bus.subscriber("orders", group="g")(handler)  # type: ignore[type-var]
    assert bus.subscriptions == []


def test_several_handlers_per_topic_and_group_share_one_subscription(bus: EventBus) -> None:
    async def first(event: A) -> None: ...
    async def second(event: B, ctx: Context) -> None: ...

    bus.subscriber("orders", group="g")(first)
    bus.subscriber("orders", group="g", max_attempts=2)(second)  # sets it for the group
    bus.subscriber("orders", group="other")(second)
    bus.subscriber("payments", group="g")(second)
    assert len(bus.subscriptions) == 3
    sub = bus.subscriptions[0]
    assert sub.models == {"A": A, "B": B} and sub.options.retry.max_attempts == 2
    assert sub.routes.get("A").call.func is first  # type: ignore[union-attr]
    assert sub.routes.get("B").call.func is second  # type: ignore[union-attr]
    assert sub.routes.get("C") is None


def test_an_event_type_has_one_handler_per_group(bus: EventBus) -> None:
    async def first(event: A) -> None: ...
    async def again(event: AlsoA) -> None: ...  # same type name "A"

    bus.subscriber("orders", group="g")(first)
    with pytest.raises(ConfigError, match="already handled by"):
        bus.subscriber("orders", group="g")(again)


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ({"on_unknown": "skip"}, {"on_unknown": "dead_letter"}),
        ({"ack": "before"}, {"ack": "after"}),
        ({"max_attempts": 3}, {"max_attempts": 4}),
        ({"on_failure": "park"}, {"on_failure": "continue"}),
    ],
)
def test_conflicting_choices_on_one_group_are_refused(
    bus: EventBus, one: dict[str, object], two: dict[str, object]
) -> None:
    async def first(event: A) -> None: ...
    async def second(event: B) -> None: ...

    bus.subscriber("orders", group="g", **one)(first)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="share one consumer"):
        bus.subscriber("orders", group="g", **two)(second)  # type: ignore[arg-type]
    bus.subscriber("orders", group="g", **one)(second)  # type: ignore[arg-type]  # repeated: fine


def test_on_unknown_is_decided_at_registration(bus: EventBus) -> None:
    async def first(event: A) -> None: ...

    with pytest.raises(ConfigError, match="on_unknown"):
        bus.subscriber("orders", group="g", on_unknown="ignore")  # type: ignore[arg-type]
    bus.subscriber("orders", group="g", on_unknown="skip")(first)
    assert bus.subscriptions[0].options.on_unknown == "skip"


def test_raw_handlers_and_type_names(bus: EventBus) -> None:
    async def typed(event: A) -> None: ...
    async def renamed(event: B) -> None: ...
    async def as_dict(event: dict) -> None: ...  # type: ignore[type-arg]
    async def as_bytes(event: bytes) -> None: ...
    async def other_dict(event: dict) -> None: ...  # type: ignore[type-arg]

    bus.subscriber("orders", group="g")(typed)
    bus.subscriber("orders", group="g", type_name=["orders.b", "OldB"])(renamed)
    bus.subscriber("orders", group="g", type_name="audit")(as_bytes)
    bus.subscriber("orders", group="g")(as_dict)  # every other type
    routes = bus.subscriptions[0].routes
    assert routes.get("A").call.func is typed  # type: ignore[union-attr]
    assert routes.get("orders.b").call.func is renamed  # type: ignore[union-attr]
    assert routes.get("OldB").call.func is renamed  # type: ignore[union-attr]
    assert routes.get("B").call.func is as_dict  # type: ignore[union-attr]  # not its name now
    assert routes.get("audit").call.func is as_bytes  # type: ignore[union-attr]
    assert routes.get("anything").call.func is as_dict  # type: ignore[union-attr]
    assert routes.get("x").convert({"k": 1}) == {"k": 1}  # type: ignore[union-attr]
    assert routes.get("audit").convert({"k": 1}) == b"\x81\xa1k\x01"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="every other"):
        bus.subscriber("orders", group="g")(other_dict)
    with pytest.raises(ConfigError, match="one model"):
        bus.subscriber("orders", group="h", type_name="x")(_same_union)


async def _same_union(event: A | B) -> None: ...


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


def test_the_package_exports_what_users_import_and_catch() -> None:
    import eventbus
    from eventbus.dlq import DeadLetters
    from eventbus.errors import HandlerTimeout, RequestTimeout
    from eventbus.protocol.topics import TopicConfig

    assert eventbus.DeadLetters is DeadLetters and eventbus.TopicConfig is TopicConfig
    assert eventbus.RequestTimeout is RequestTimeout and eventbus.HandlerTimeout is HandlerTimeout
    assert eventbus.__version__ == "0.1.0"  # pyproject.toml's version
    assert set(eventbus.__all__) <= set(dir(eventbus))
