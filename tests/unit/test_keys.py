"""Key layout: coordination keys share one hashtag, data keys carry none."""

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
