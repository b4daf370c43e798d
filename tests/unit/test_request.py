"""A caller's reply stream (`eventbus.request.Requester`): what it keeps while a request's
publish is on its way."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from eventbus.protocol.codec import Envelope, encode_entry
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import CORRELATION_ID
from eventbus.request import EARLY_MAX, Requester, _Waiting

pytestmark = pytest.mark.anyio


async def test_replies_held_before_the_publish_returns_are_capped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a writer of the reply stream floods it with entries naming a request's correlation ID
    # while that request's entry ID is unknown: held up to EARLY_MAX, the rest dropped, logged
    requester = Requester(redis=None, keys=Keys(), topic="quotes")
    waiting = _Waiting(shard=0, future=asyncio.get_running_loop().create_future())
    requester._waiting["c1"] = waiting
    fields = encode_entry(
        Envelope("r", "Price", os.urandom(16), 1, headers={CORRELATION_ID: "c1"}, payload={})
    )
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        for i in range(EARLY_MAX + 3):
            requester._accept(f"1-{i}", fields)
    assert len(waiting.early) == EARLY_MAX
    dropped = [r.getMessage() for r in caplog.records if " dropped: " in r.getMessage()]
    assert [m.split(": entry ")[1].split()[0] for m in dropped] == [
        f"1-{i}" for i in range(EARLY_MAX, EARLY_MAX + 3)
    ]
