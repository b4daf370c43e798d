"""`SubscriberOptions`: every option of ``@bus.subscriber`` checked once, when it is called, with
a `ConfigError` naming the option, and the options of a (topic, group) merged
across its handlers. docs/operations.md's option table lists exactly its fields."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from eventbus import ConfigError, EventBus, Settings
from eventbus.consumer.options import FIELDS, SubscriberArgs, SubscriberOptions

DOCS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


class A(BaseModel):
    n: int


@pytest.fixture
def bus() -> EventBus:
    return EventBus(Settings(max_attempts=5, retry_base_s=0.2, handler_timeout_s=30))


@pytest.mark.parametrize("bad", [5, b"x", [None], ["ok", ""], {"A": 1}, ("A", 2)])
def test_a_bad_type_name_is_a_config_error_naming_it(bus: EventBus, bad: Any) -> None:
    with pytest.raises(ConfigError, match="type_name must be"):
        bus.subscriber("t", group="g", type_name=bad)


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("max_attempts", 0),
        ("max_attempts", 1.5),
        ("max_attempts", "3"),
        ("max_attempts", True),
        ("retry_base_s", -1),
        ("retry_max_s", "1"),
        ("dedup_window_s", float("nan")),
        ("handler_timeout_s", -0.5),
        ("max_batch", 0),
        ("batch", "yes"),
        ("broadcast", 1),
        ("ack", "never"),
        ("on_failure", None.__class__),
        ("on_unknown", "ignore"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(bus: EventBus, option: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"^{option} must be"):
        bus.subscriber("t", group="g", **{option: bad})


@pytest.mark.parametrize("option", sorted(SubscriberArgs.__optional_keys__ - {"group"}))
def test_every_option_given_an_odd_object_says_what_it_must_be(bus: EventBus, option: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{option} must be .+, got <object object"):
        bus.subscriber("t", group="g", **{option: object()})


def test_an_odd_object_is_shown_cut_short(bus: EventBus) -> None:
    """An option given a huge object names it in a bounded message, not its whole repr."""
    huge = {f"key{i}": "x" * 100 for i in range(1000)}
    with pytest.raises(ConfigError) as caught:
        bus.subscriber("t", group="g", type_name=huge)  # type: ignore[arg-type]
    assert len(str(caught.value)) < 200


def test_options_are_resolved_against_the_settings(bus: EventBus) -> None:
    options = SubscriberOptions.of(bus.settings, "t", group="g", retry_max_s=9)
    assert (options.max_attempts, options.retry_base_s, options.retry_max_s) == (5, 0.2, 9)
    assert options.handler_timeout_s == 30 and options.given == {"retry_max_s"}
    assert (
        SubscriberOptions.of(bus.settings, "t", group="g", handler_timeout_s=0).handler_timeout_s
        is None
    )
    assert SubscriberOptions.of(bus.settings, "t", broadcast=True).group == "_broadcast"
    assert (
        SubscriberOptions.of(bus.settings, "t", group="x", broadcast=True).group == "_broadcast.x"
    )


def test_merging_applies_what_a_handler_set_and_refuses_a_conflict(bus: EventBus) -> None:
    first = SubscriberOptions.of(bus.settings, "t", group="g", ack="before")
    second = SubscriberOptions.of(bus.settings, "t", group="g", max_attempts=2)
    merged = first.merge(second, "topic 't', group 'g': h2")
    assert (merged.ack, merged.max_attempts, merged.given) == ("before", 2, {"ack", "max_attempts"})
    assert merged.merge(first, "again") == merged  # repeating an option is fine
    other = SubscriberOptions.of(bus.settings, "t", group="g", ack="after")
    with pytest.raises(ConfigError, match="sets ack='after', but another handler of the group"):
        merged.merge(other, "topic 't', group 'g': h3")


def test_the_docs_option_table_lists_every_option() -> None:
    text = DOCS.read_text()
    table = text[text.index("| Subscriber option | Default |") :].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == list(FIELDS)


def test_the_keyword_record_names_every_option() -> None:
    # `@bus.subscriber`'s keywords (`SubscriberArgs`) are the record's fields, type_name being
    # kept as type_names: an option added to one and not the other fails here
    keywords = set(SubscriberArgs.__optional_keys__)
    assert keywords == {*FIELDS} - {"type_names"} | {"type_name"}
    assert set(inspect.signature(EventBus.subscriber).parameters) == {"self", "topic", "options"}


def test_a_misspelt_option_is_a_config_error_naming_it(bus: EventBus) -> None:
    with pytest.raises(ConfigError, match=r"no option \['max_attempt'\]"):
        bus.subscriber("t", group="g", max_attempt=3)  # type: ignore[call-arg]
