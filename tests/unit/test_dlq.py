"""The pure parts of `eventbus.dlq`: the dead-letter record written and parsed back, control
entries. The operator API (`DeadLetters`) runs in the shared failure-policy cases."""

from __future__ import annotations

import pytest

from eventbus.dlq import DROP, UNPARK, DeadLetter, control_entry, dead_letter_fields, is_control
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, decode_entry
from eventbus.protocol.dead_letters import parked_resources

ORIGINAL = {F_RESOURCE: b"o-1", F_TYPE: b"OrderPlaced", F_DATA: b"\x01\x80"}


def letter_fields(**overrides: object) -> dict[bytes, bytes]:
    values: dict[str, object] = {
        "topic": "orders",
        "group": "billing",
        "shard": 3,
        "entry_id": b"5-1",
        "reason": "failed",
        "exc": ValueError("bad total"),
        "attempts": 4,
        "original": ORIGINAL,
    }
    values.update(overrides)
    return dead_letter_fields(**values)  # type: ignore[arg-type]


def test_a_dead_letter_parses_back_to_what_was_written() -> None:
    letter = DeadLetter.parse(b"9-0", letter_fields())
    assert (letter.dlq_id, letter.shard, letter.entry_id) == ("9-0", 3, "5-1")
    assert (letter.resource_id, letter.event_type, letter.reason) == (
        "o-1",
        "OrderPlaced",
        "failed",
    )
    assert (letter.error_type, letter.error, letter.attempts) == ("ValueError", "bad total", 4)
    assert letter.failed_at_ms > 0 and letter.problems == ()
    assert letter.original() == ORIGINAL


def test_a_parked_letter_has_no_exception() -> None:
    letter = DeadLetter.parse("1-0", letter_fields(reason="parked", exc=None, attempts=0))
    assert (letter.reason, letter.error_type, letter.error) == ("parked", "", "resource is parked")


def test_the_error_message_is_cut_to_4_kib() -> None:
    fields = letter_fields(exc=RuntimeError("x" * 10_000))
    assert len(fields[b"error"]) == 4096


def test_an_entry_id_may_be_given_as_text() -> None:
    assert letter_fields(entry_id="7-7")[b"entry_id"] == b"7-7"


def test_parse_never_raises_and_names_what_is_wrong() -> None:
    letter = DeadLetter.parse(b"1-0", {b"shard": b"three", b"attempts": b"x", b"reason": b"\xff"})
    assert (letter.shard, letter.attempts, letter.resource_id) == (-1, 0, None)
    assert letter.reason == "\ufffd"
    assert len(letter.problems) == 3
    assert any("shard is not an integer" in p for p in letter.problems)
    assert any("orig_data" in p for p in letter.problems)
    assert letter.original() == {}


def test_a_letter_without_reason_counts_as_failed() -> None:
    fields = letter_fields()
    del fields[b"reason"]
    assert DeadLetter.parse("1-0", fields).reason == "failed"


def test_control_entries_are_recognised_and_carry_group_and_nonce() -> None:
    for kind in (UNPARK, DROP):
        fields = control_entry(kind, "o-1", "billing", nonce="n1")
        assert is_control(fields)
        env = decode_entry(fields)
        assert (env.resource_id, env.event_type) == ("o-1", kind)
        assert env.payload == {"group": "billing", "nonce": "n1"}
    assert not is_control(ORIGINAL)
    assert not is_control({b"junk": b"1"})


def _raise_chained(depth: int) -> None:
    try:
        if depth == 0:
            raise KeyError("where it broke")
        _raise_chained(depth - 1)
    except KeyError as exc:
        raise KeyError(f"level {depth}") from exc


def test_the_traceback_is_kept_with_its_innermost_frames_within_4_kib() -> None:
    try:
        _raise_chained(60)  # a chain of tracebacks far over 4 KiB
    except KeyError as exc:
        fields = letter_fields(exc=exc)
    tb = fields[b"traceback"]
    assert 3000 < len(tb) <= 4096
    assert tb.endswith(b"KeyError: 'level 60'\n")  # the tail: the last raise
    assert b"_raise_chained" in tb
    letter = DeadLetter.parse(b"9-0", fields)
    assert letter.traceback == tb.decode()


def test_a_short_traceback_is_whole_and_a_parked_letter_has_none() -> None:
    try:
        raise ValueError("bad total")
    except ValueError as exc:
        tb = letter_fields(exc=exc)[b"traceback"].decode()
    assert tb.startswith("Traceback (most recent call last):")
    assert "test_a_short_traceback_is_whole" in tb and tb.endswith("ValueError: bad total\n")
    parked = DeadLetter.parse("1-0", letter_fields(reason="parked", exc=None, attempts=0))
    assert parked.traceback == ""


def test_parked_fields_that_are_not_utf8_are_left_out_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = {b"\xff\xfe": b"1-0", b"order-1": b"2-0", b"order-2": b"\xff"}

    with caplog.at_level("WARNING", logger="eventbus.dlq"):
        parked = parked_resources(raw, "eventbus:parked:{x}:orders:billing")

    assert parked == {"order-1": "2-0", "order-2": "\ufffd"}
    assert "eventbus:parked:{x}:orders:billing" in caplog.text
    assert "b'\\xff\\xfe'" in caplog.text
