"""Raw XREADGROUP replies parsed into redis-py's shapes (`eventbus.consumer.raw_replies`)."""

from __future__ import annotations

import pytest

from eventbus.consumer.raw_replies import fields_of, parse_xread


def test_an_entry_of_three_fields_and_of_other_lengths_parse_alike() -> None:
    three = [b"rid", b"r1", b"type", b"t", b"data", b"\x01x"]
    reply = [[b"s:0", [[b"1-0", three], [b"2-0", [b"a", b"1"]], [b"3-0", None]]]]
    assert parse_xread(reply) == [
        (
            b"s:0",
            [
                (b"1-0", {b"rid": b"r1", b"type": b"t", b"data": b"\x01x"}),
                (b"2-0", {b"a": b"1"}),
                (b"3-0", None),  # deleted while pending
            ],
        )
    ]
    eight = [b"a", b"1", b"b", b"2", b"c", b"3", b"d", b"4"]
    assert fields_of(eight) == {b"a": b"1", b"b": b"2", b"c": b"3", b"d": b"4"}
    assert fields_of([]) == {}


def test_a_repeated_field_keeps_its_last_value_as_redis_py_does() -> None:
    assert fields_of([b"a", b"1", b"b", b"2", b"a", b"3"]) == {b"a": b"3", b"b": b"2"}


def test_a_resp3_map_is_copied_and_an_odd_list_is_refused() -> None:
    flat = {b"a": b"1"}
    got = fields_of(flat)
    assert got == flat and got is not flat
    with pytest.raises(ValueError, match="odd length"):
        fields_of([b"a", b"1", b"b"])
