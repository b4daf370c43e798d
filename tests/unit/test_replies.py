"""The reply format of `eventbus.protocol.replies`: which reply streams a request may name
(one topic's), which request entry a reply must name, the headers tools redact."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from eventbus.errors import InvalidReply
from eventbus.protocol.codec import Envelope, envelope_of
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import (
    REPLY_KEY,
    REPLY_TO,
    REQUEST_ENTRY,
    answers,
    redacted,
    reply_stream,
)


class Price(BaseModel):
    cents: int


def test_a_reply_stream_is_one_topics_and_of_the_documented_form() -> None:
    stream = Keys().reply("quotes", "ab" * 16)
    assert stream == "eventbus:reply:quotes:" + "ab" * 16
    assert reply_stream(Keys(), {REPLY_TO: stream}) == stream
    assert reply_stream(Keys(), {}) is None  # no request
    for bad in (
        "eventbus:reply:" + "ab" * 16,  # an eventbus from before per-topic reply streams
        "eventbus:reply:quotes:" + "AB" * 16,
        "eventbus:reply:quotes:" + "ab" * 15,
        "eventbus:reply:a:b:" + "ab" * 16,
        "eventbus:reply:..:" + "ab" * 16,
        "eventbus:stream:quotes:0",
        "other:reply:quotes:" + "ab" * 16,
    ):
        with pytest.raises(InvalidReply, match="is not an eventbus reply stream"):
            reply_stream(Keys(), {REPLY_TO: bad})


def test_a_reply_answers_only_the_request_entry_it_names() -> None:
    def reply(headers: dict[str, str]) -> Envelope:
        return envelope_of("a", Price(cents=1), headers)

    ok = reply({REQUEST_ENTRY: "3/1700000000000-0"})
    assert answers(ok, 3, "1700000000000-0") is None
    assert "not '2/1700000000000-0'" in str(answers(ok, 2, "1700000000000-0"))
    assert "not '3/1700000000000-1'" in str(answers(ok, 3, "1700000000000-1"))
    assert "names no request entry" in str(answers(reply({}), 3, "1-0"))


def test_tools_show_a_reply_key_as_stars() -> None:
    headers = {REPLY_KEY: "ab" * 32, "trace": "x"}
    assert redacted(headers) == {REPLY_KEY: "***", "trace": "x"}
    assert headers[REPLY_KEY] == "ab" * 32  # the entry's own headers untouched
