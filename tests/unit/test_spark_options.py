"""Option names of ``format("eventbus")``: Kafka-style camelCase with the older names as aliases, a
misspelled option refused naming the close match, and Kafka's topic-keyed ``startingOffsets``."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from eventbus.errors import ConfigError
from eventbus.spark.options import SourceOptions
from eventbus.spark.stream import parse_start

BASE = {"store": "memory://", "topic": "orders"}


def test_camel_case_names_and_their_aliases_parse_alike() -> None:
    camel = SourceOptions.parse(
        {**BASE, "redisUrl": "redis://h:6379/0", "keyPrefix": "p", "maxOffsetsPerTrigger": "50"}
    )
    old = SourceOptions.parse(
        {**BASE, "redis_url": "redis://h:6379/0", "key_prefix": "p", "maxEntriesPerTrigger": "50"}
    )
    assert camel == old
    assert (camel.redis_url, camel.key_prefix, camel.max_entries_per_trigger) == (
        "redis://h:6379/0",
        "p",
        50,
    )
    assert SourceOptions.parse({**BASE, "MAXOFFSETSPERTRIGGER": "7"}).max_entries_per_trigger == 7


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("redis_ur", "did you mean 'redis_url'"),
        ("maxOffsetPerTrigger", "did you mean 'maxOffsetsPerTrigger'"),
        ("startingOffset", "did you mean 'startingOffsets'"),
        ("modell", "did you mean 'model'"),
        ("zzzz", "the options are store, topic, subscribe, redisUrl"),
    ],
)
def test_an_unknown_option_is_an_error_naming_the_close_match(name: str, hint: str) -> None:
    """It used to be ignored: a misspelled redis_url read the archive only, silently."""
    with pytest.raises(ConfigError, match=f"unknown option '{name}'.*{hint}"):
        SourceOptions.parse({**BASE, name: "x"})


def test_an_option_and_its_alias_with_two_values_is_an_error() -> None:
    with pytest.raises(ConfigError, match="maxOffsetsPerTrigger given twice"):
        SourceOptions.parse({**BASE, "maxOffsetsPerTrigger": "5", "maxEntriesPerTrigger": "6"})
    same = {**BASE, "maxOffsetsPerTrigger": "5", "maxEntriesPerTrigger": "5"}
    assert SourceOptions.parse(same).max_entries_per_trigger == 5


def test_starting_offsets_keyed_by_topic_as_kafka() -> None:
    assert parse_start('{"orders": {"0": "17-0", "3": "18-2"}}', "orders") == {
        "0": "17-0",
        "3": "18-2",
    }
    assert parse_start('{"0": "17-0"}', "orders") == {"0": "17-0"}
    with pytest.raises(ConfigError, match=r"names topics \['payments'\], not 'orders'"):
        parse_start('{"payments": {"0": "17-0"}}', "orders")


@pytest.mark.parametrize(
    "url",
    [
        "http://u:s3cret-pw@h:6379/0",  # wrong scheme
        "redis://:s3cret-pw@h:port/0",  # the port is not a number
        "redis://:s3cret-pw@h:6379/0#x",  # '#' in the URL
    ],
)
def test_a_bad_redis_url_option_is_refused_without_its_password(url: str) -> None:
    """The ConfigError names the option and shows the URL redacted."""
    with pytest.raises(ConfigError, match="option redis_url") as info:
        SourceOptions.parse({"store": "memory://", "topic": "orders", "redisUrl": url})
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize("name", ["pushdown", "native", "validate", "failOnDataLoss"])
def test_every_boolean_option_is_validated(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"option {name} must be true or false"):
        SourceOptions.parse({**BASE, name: "maybe"})
    assert SourceOptions.parse({**BASE, name: "FALSE"}) is not None


def test_starting_timestamp_is_unix_ms_and_excludes_starting_offsets() -> None:
    assert SourceOptions.parse({**BASE, "startingTimestamp": "1700000000000"}).starting_timestamp
    with pytest.raises(ConfigError, match="startingTimestamp must be an integer"):
        SourceOptions.parse({**BASE, "startingTimestamp": "yesterday"})
    with pytest.raises(ConfigError, match="startingTimestamp and startingOffsets exclude"):
        SourceOptions.parse({**BASE, "startingTimestamp": "1", "startingOffsets": "earliest"})


def test_the_coordination_slots_option_reads_the_checkpoints_of_that_layout() -> None:
    default = SourceOptions.parse(BASE).keys()
    per_topic = SourceOptions.parse({**BASE, "coordinationSlots": "topic"}).keys()
    assert default.checkpoints("orders") == "eventbus:{eventbus}:checkpoints:orders"
    assert per_topic.checkpoints("orders") == "eventbus:{eventbus:orders}:checkpoints:orders"
    assert SourceOptions.parse({**BASE, "coordination_slots": "topic"}).keys() == per_topic
    with pytest.raises(ConfigError, match="option coordinationSlots must be 'shared' or 'topic'"):
        SourceOptions.parse({**BASE, "coordinationSlots": "nodes"})
