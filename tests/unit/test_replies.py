"""The reply MAC of `eventbus.protocol.replies` (issue 20 item 3): the test vector of
docs/protocol.md, what `verify_reply` refuses, which reply keys a request may carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eventbus.errors import InvalidReply
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import (
    F_MAC,
    REPLY_KEY,
    REPLY_TO,
    new_reply_key,
    reply_key,
    reply_mac,
    reply_stream,
    verify_reply,
)

KEY = bytes(range(32))
FIELDS = {b"rid": b"order-1", b"type": b"Price", b"data": b"\x01x"}
VECTOR = "d99b5f06492f909f473149a0c3a87bdb9fd6022a7a901cd9e5f273c5269b5e78"


def test_the_documented_test_vector() -> None:
    assert reply_mac(KEY, "c1", FIELDS).hex() == VECTOR
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    assert KEY.hex() in doc and f"`mac` = `{VECTOR}`" in doc


def test_verify_reply_accepts_only_the_mac_of_this_key_correlation_id_and_content() -> None:
    good = {**FIELDS, F_MAC: VECTOR.encode()}
    assert verify_reply(KEY, "c1", good) is None
    assert verify_reply(KEY, "c1", FIELDS) == "it has no mac field"
    mismatch = "its mac does not match its content"
    assert verify_reply(bytes(32), "c1", good) == mismatch  # another request's secret
    assert verify_reply(KEY, "c2", good) == mismatch  # another request
    for name in (b"rid", b"type", b"data"):
        assert verify_reply(KEY, "c1", {**good, name: good[name] + b"!"}) == mismatch
    assert verify_reply(KEY, "c1", {**good, F_MAC: VECTOR.upper().encode()}) == mismatch
    # length prefixes: moving a byte from one field to the next changes the MAC
    shifted = {**good, b"rid": b"order-", b"type": b"1Price"}
    assert verify_reply(KEY, "c1", shifted) == mismatch
    assert verify_reply(KEY, "c1", {F_MAC: VECTOR.encode()}) == "it lacks field b'rid'"


def test_a_request_key_is_64_lowercase_hex_digits() -> None:
    key = new_reply_key()
    assert len(key) == 32 and key != new_reply_key()
    assert reply_key({REPLY_KEY: key.hex()}) == key
    assert reply_key({}) is None  # a request of an eventbus from before the MAC
    stream = Keys().reply("ab" * 16)
    for bad in ("", "AB" * 32, "ab" * 31, "ab" * 33, "zz" * 32, " " + "ab" * 32):
        with pytest.raises(InvalidReply, match=re.escape(REPLY_KEY)):
            reply_key({REPLY_KEY: bad})
        with pytest.raises(InvalidReply, match="64 lowercase hex digits"):
            reply_stream(Keys(), {REPLY_TO: stream, REPLY_KEY: bad})
    assert reply_stream(Keys(), {REPLY_TO: stream, REPLY_KEY: key.hex()}) == stream
