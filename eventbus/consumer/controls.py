"""Control entries' helpers for the failure policy (`eventbus.consumer.failures`): whether a
control entry is the operator's (`forged`), and the parked letters a requeue replays or a drop
deletes, in order (`parked_letters`). `redis` is typed Any as in `Failures`: redis-py types
replies for its sync and async clients at once."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from redis.asyncio.retry import Retry

from eventbus.client import retry as retrying
from eventbus.consumer.delivery import Delivery
from eventbus.errors import ForgedControlEntry
from eventbus.protocol.dead_letters import DROP, UNPARK, DeadLetter, control_request
from eventbus.protocol.ids import EntryId, parse_id

log = logging.getLogger("eventbus.consumer")

LETTERS_PAGE = 500  # dead letters per XRANGE of a scan


async def forged(
    redis: Any, retry: Retry, requests: str, d: Delivery, nonce: object, kind: str, rid: str
) -> ForgedControlEntry | None:
    """Why control entry `d` is not the operator's (None when its `nonce` names a request for
    `kind` on `rid` recorded in the hash `requests` of `redis`)."""
    entry = d.entry_id.decode()
    if kind not in (DROP, UNPARK):
        return ForgedControlEntry(entry, f"unknown control type {kind!r}: no request recorded")
    if not isinstance(nonce, str) or not nonce:
        return ForgedControlEntry(entry, "it carries no nonce: no request recorded")
    request = await retrying.call(
        retry, "control request lookup", lambda: redis.hget(requests, nonce)
    )
    if request is None:
        return ForgedControlEntry(entry, "no request recorded under its nonce")
    if request != control_request(kind, rid):
        return ForgedControlEntry(entry, "no request recorded for this kind and resource")
    return None


async def parked_letters(
    redis: Any, retry: Retry, dlq: str, rid: str, first_id: str
) -> list[DeadLetter]:
    """Resource `rid`'s parked letters in the dead-letter stream `dlq` from `first_id` on
    (failed or parked, not undecodable), in order: each of an entry after the last one kept (a
    resource's entries lie in one shard stream, so entry-ID order is publish order). A letter of
    an earlier or the same entry is passed over, logged: written late by a consumer that had
    lost the shard (its dead-letter XADD is fenced by the client only), or twice for one entry
    redelivered; replaying it would run that event again after later ones."""
    letters: list[DeadLetter] = []
    last: EntryId | None = None
    start = first_id
    while True:
        rows = await retrying.call(
            retry,
            "dead-letter scan",
            partial(redis.xrange, dlq, min=start, count=LETTERS_PAGE),
        )
        for dlq_id, fields in rows:
            letter = DeadLetter.parse(dlq_id, fields)
            if letter.resource_id != rid or letter.reason not in ("failed", "parked"):
                continue
            try:
                entry = parse_id(letter.entry_id)
            except ValueError:
                entry = None  # (a malformed letter: replayed where it stands)
            if entry is not None and last is not None and entry <= last:
                log.warning(
                    "parked letter %s of entry %s (resource %r) passed over: not after "
                    "entry %s, replayed before it",
                    letter.dlq_id,
                    letter.entry_id,
                    rid,
                    last,
                )
                continue
            last = entry or last
            letters.append(letter)
        if len(rows) < LETTERS_PAGE:
            return letters
        start = "(" + rows[-1][0].decode()
