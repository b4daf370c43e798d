"""Key layout: coordination keys share one hashtag (or one per topic), data keys carry none."""

from __future__ import annotations

import re

import pytest

from eventbus.errors import ConfigError
from eventbus.protocol.keys import Keys, check_name
from eventbus.protocol.topics import TopicConfig

HASHTAG = re.compile(r"\{([^}]*)\}")


def _hashtag(key: str) -> str | None:
    """The part of `key` Redis Cluster hashes (the first non-empty {...}), or None."""
    m = HASHTAG.search(key)
    return m.group(1) if m and m.group(1) else None


@pytest.mark.parametrize("keys", [Keys(), Keys(prefix="svc", hashtag="coord-1")])
def test_coordination_keys_share_the_hashtag(keys: Keys) -> None:
    coord = [
        keys.topics(),
        keys.locks("orders", "billing"),
        keys.locks("flights", "agg"),
        keys.members("orders", "billing"),
        keys.checkpoints("orders"),
    ]
    assert {_hashtag(k) for k in coord} == {keys.hashtag}
    assert all(k.startswith(f"{keys.prefix}:") for k in coord)
    assert len(set(coord)) == len(coord)


@pytest.mark.parametrize("keys", [Keys(), Keys(prefix="svc", hashtag="coord-1")])
def test_data_keys_have_no_braces(keys: Keys) -> None:
    data = [keys.stream("orders", s) for s in range(64)] + [keys.dead_letter("orders", "billing")]
    assert not any("{" in k or "}" in k for k in data)
    assert all(k.startswith(f"{keys.prefix}:") for k in data)
    assert len(set(data)) == len(data)


def test_layout_is_the_documented_one() -> None:
    keys = Keys()
    assert keys.stream("orders", 3) == "eventbus:stream:orders:3"
    assert keys.dead_letter("orders", "billing") == "eventbus:dlq:orders:billing"
    assert keys.locks("orders", "billing") == "eventbus:{eventbus}:locks:orders:billing"
    assert keys.members("orders", "billing") == "eventbus:{eventbus}:members:orders:billing"
    assert keys.topics() == "eventbus:{eventbus}:topics"


def test_keys_of_different_topics_and_groups_do_not_collide() -> None:
    keys = Keys()
    # "a.b" + "c" must not meet "a" + "b.c" etc.: the separator cannot occur in names
    assert keys.locks("a.b", "c") != keys.locks("a", "b.c")
    assert keys.stream("orders", 1) != keys.stream("orders-1", 1)
    assert keys.dead_letter("t", "g") != keys.dead_letter("g", "t")


@pytest.mark.parametrize(
    "name",
    ["", "a:b", "a b", "{x}", "x}", "é", "a/b", "x" * 101, "tab\t", None, 5, ".", "..", "-x", "--"],
)
def test_invalid_names_are_rejected(name: object) -> None:
    with pytest.raises(ConfigError):
        check_name("topic", name)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TopicConfig(name, 4, 100)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["orders", "a", "A-b_c.9", "x" * 100, "...", ".a", "a-", "_x"])
def test_valid_names_pass(name: str) -> None:
    assert check_name("group", name) == name


@pytest.mark.parametrize(("prefix", "hashtag"), [("a:b", "x"), ("ok", "{x}"), ("", "x")])
def test_invalid_prefix_or_hashtag_rejected(prefix: str, hashtag: str) -> None:
    with pytest.raises(ConfigError):
        Keys(prefix, hashtag)


def _topic_keys(keys: Keys, topic: str) -> list[str]:
    """Every coordination key of one topic that a script or an operator command touches with
    the others: members, locks, epochs, parked and control hashes (two groups, the offloader's
    included) and checkpoints."""
    return [
        f(topic, g)
        for g in ("billing", "_offloader")
        for f in (keys.members, keys.locks, keys.lock_epoch, keys.parked, keys.control)
    ] + [keys.checkpoints(topic)]


@pytest.mark.parametrize("keys", [Keys(slots="topic"), Keys("svc", "coord-1", "topic")])
def test_the_per_topic_layout_gives_each_topic_its_own_hashtag(keys: Keys) -> None:
    orders, flights = _topic_keys(keys, "orders"), _topic_keys(keys, "flights")
    assert {_hashtag(k) for k in orders} == {f"{keys.hashtag}:orders"}
    assert {_hashtag(k) for k in flights} == {f"{keys.hashtag}:flights"}
    assert keys.topic_hashtag("orders") == f"{{{keys.hashtag}:orders}}"
    # the deployment's keys stay in the shared slot: one registry for every topic
    deployment = [keys.topics(), keys.retention(), keys.dictionaries("orders")]
    assert {_hashtag(k) for k in deployment} == {keys.hashtag}
    assert len(set(orders + flights + deployment)) == len(orders + flights + deployment)


def test_the_per_topic_layout_keeps_the_shared_layouts_key_names_after_the_hashtag() -> None:
    """Only the hashtag differs: ACL patterns of a key family (``...:locks:*``) translate by
    replacing ``{eventbus}`` with ``{eventbus:*}`` (docs/security.md)."""
    shared, per_topic = Keys(), Keys(slots="topic")
    assert per_topic.locks("orders", "billing") == "eventbus:{eventbus:orders}:locks:orders:billing"
    assert per_topic.lock_epoch("orders", "g") == "eventbus:{eventbus:orders}:locks:epoch:orders:g"
    assert per_topic.checkpoints("orders") == "eventbus:{eventbus:orders}:checkpoints:orders"
    for s, t in zip(_topic_keys(shared, "orders"), _topic_keys(per_topic, "orders"), strict=True):
        assert t == s.replace("{eventbus}", "{eventbus:orders}")
    assert per_topic.topics() == shared.topics()
    assert per_topic.dictionaries("orders") == shared.dictionaries("orders")
    assert per_topic.stream("orders", 3) == shared.stream("orders", 3)
    assert shared.topic_hashtag("orders") == "{eventbus}"


def test_keys_follow_the_coordination_slots_setting() -> None:
    from eventbus.config import Settings

    assert Keys.of(Settings()) == Keys()
    settings = Settings(key_prefix="svc", hashtag="h", coordination_slots="topic")
    assert Keys.of(settings).members("orders", "g") == "svc:{h:orders}:members:orders:g"


@pytest.mark.parametrize("slots", ["", "group", "Topic", None])
def test_an_unknown_layout_is_refused(slots: object) -> None:
    with pytest.raises(ConfigError, match="coordination slots"):
        Keys(slots=slots)  # type: ignore[arg-type]
