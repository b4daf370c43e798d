"""The handling path (`eventbus.consumer.handling.Handling.step`): decode errors, unknown types,
step outcomes and the failure policy, with a fake `Fence`; dead letters and parking go to
fakeredis."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.consumer.context import Context, HandlerCall, Subscription
from eventbus.consumer.delivery import Delivery, Outcome
from eventbus.consumer.failures import Failures
from eventbus.consumer.handling import Handling
from eventbus.consumer.options import SubscriberOptions
from eventbus.consumer.routing import Routes
from eventbus.dlq import DeadLetter, control_entry, control_request
from eventbus.errors import DecodeError, UnknownEventType
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, encode_entry, new_event_id
from eventbus.protocol.dead_letters import dead_letter_fields
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig

pytestmark = pytest.mark.anyio

KEYS = Keys()
TOPIC = TopicConfig("orders", 2, 10_000)
DLQ = KEYS.dead_letter("orders", "g")
PARKED = KEYS.parked("orders", "g")
LOCKS = KEYS.locks("orders", "g")


class Tick(BaseModel):
    resource: str
    seq: int


class Strict(BaseModel):
    code: str

    @field_validator("code", mode="before")
    @classmethod
    def upper(cls, v: str) -> str:
        return v.upper()  # AttributeError for an int: not a pydantic ValidationError


class Fence:
    """A `Fence` whose answers are scripted: `waits` answers `wait` in turn (then True), and
    `holding` answers `holds` (a fence that holds would not make `wait` wait: `step` asks
    `holds` first and `wait` only when it does not hold)."""

    def __init__(self, *, waits: Iterator[bool] | None = None, holding: bool = True) -> None:
        self.waits = waits or iter(())
        self.holding = holding

    def holds(self, d: Delivery) -> bool:
        return self.holding

    async def wait(self, d: Delivery) -> bool:
        return next(self.waits, True)


class Harness:
    def __init__(self, redis: Any, **sub: Any) -> None:
        self.redis = redis
        self.calls: list[tuple[Any, Context]] = []
        self.fail_with: Exception | None = None

        async def handle(event: Any, ctx: Context) -> None:
            self.calls.append((event, ctx))
            if self.fail_with is not None:
                raise self.fail_with

        options: dict[str, Any] = {
            "group": "g",
            "max_attempts": 3,
            "retry_base_s": 0.1,
            "retry_max_s": 0.3,
        }
        options.update(sub)
        call = HandlerCall(handle, takes_context=True)
        routes = Routes()
        models = routes.add(call, {"Tick": Tick, "Strict": Strict}, None, None)
        subscription = Subscription(
            topic=TOPIC,
            options=SubscriberOptions.of(Settings(handler_timeout_s=0), TOPIC.name, **options),
            call=call,
            models=models,
            routes=routes,
        )
        member = Member(redis, KEYS, Settings(), TOPIC.name, "g", "c-1", EVENTBUS)
        self.fenced_off: list[Delivery] = []  # deliveries whose fenced write Redis refused
        redis_retry = retry.forever(0.001, 0.01)
        failures = partial(
            Failures, member, subscription, redis_retry, fenced_off=self.fenced_off.append
        )
        self.handling = Handling(member, subscription, redis_retry, failures)

    async def letters(self) -> list[DeadLetter]:
        return [DeadLetter.parse(i, f) for i, f in await self.redis.xrange(DLQ)]

    async def hold(self, owner: str = "c-1", token: int = 7) -> None:
        """The group's lock of shard 1 (`delivery`'s) as `owner` holds it with `token`: the
        writes to the parked set and control requests are fenced by it (lua/fenced_hash.lua)."""
        await self.redis.hset(LOCKS, mapping={"1": owner, "1:token": token})


def entry(rid: str = "r1", event_type: str = "Tick", payload: Any = None, **kw: Any) -> Envelope:
    return Envelope(
        resource_id=rid,
        event_type=event_type,
        event_id_bytes=kw.get("event_id", new_event_id()),
        published_at_ms=1_700_000_000_000,
        headers=kw.get("headers", {}),
        payload={"resource": rid, "seq": 1} if payload is None else payload,
    )


def delivery(fields: dict[bytes, bytes], n: int = 1) -> Delivery:
    return Delivery(shard=1, token=7, entry_id=f"{n}-0".encode(), fields=fields, generation=3)


@pytest.fixture
def h(fake_redis: Any) -> Harness:
    return Harness(fake_redis)


async def test_a_handled_entry_is_acked_with_its_context(h: Harness) -> None:
    env = entry(headers={"k": "v"})
    d = delivery(encode_entry(env))
    assert await h.handling.step(d, Fence()) is Outcome.ACK
    [(event, ctx)] = h.calls
    assert event == Tick(resource="r1", seq=1)
    assert (ctx.topic, ctx.group, ctx.shard, ctx.entry_id) == ("orders", "g", 1, "1-0")
    assert (ctx.resource_id, ctx.event_type, ctx.headers) == ("r1", "Tick", {"k": "v"})
    assert (ctx.event_id_bytes, ctx.published_at_ms) == (env.event_id_bytes, env.published_at_ms)
    assert (ctx.attempt, ctx.fencing_token, ctx.consumer_id) == (1, 7, "c-1")
    assert (h.handling.tally.handled, d.attempt) == (1, 1)


async def test_no_fence_lets_the_entry_go_untouched(h: Harness) -> None:
    d = delivery(encode_entry(entry()))
    assert await h.handling.step(d, Fence(waits=iter([False]), holding=False)) is Outcome.LET_GO
    assert h.calls == [] and d.attempt == 0 and await h.letters() == []


async def test_fence_lost_between_decode_and_call_starts_nothing(h: Harness) -> None:
    """`wait` said yes, `holds` (checked right before the call) says no: NOT_STARTED, which
    `step` turns into an immediate retry (0 s) without counting an attempt."""
    d = delivery(encode_entry(entry()))
    assert await h.handling.step(d, Fence(holding=False)) == 0.0
    assert h.calls == [] and d.attempt == 0 and h.handling.tally.handled == 0
    assert await h.handling.step(d, Fence()) is Outcome.ACK
    assert [ctx.attempt for _, ctx in h.calls] == [1]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({b"junk": b"\xff"}, "lacks field"),
        ({F_RESOURCE: b"r1", F_TYPE: b"Tick", F_DATA: b"\x01\xc1"}, "corrupt"),
        ({F_RESOURCE: b"r1", F_TYPE: b"Tick", F_DATA: b"\x02zz"}, None),
    ],
)
def test_undecodable_bytes_raise_decode_error(
    fields: dict[bytes, bytes], match: str | None
) -> None:
    with pytest.raises(DecodeError, match=match):
        Harness(None).handling.decode(fields)


def test_unknown_event_type_names_the_expected_ones() -> None:
    h = Harness(None)
    with pytest.raises(UnknownEventType, match=r"'Other'.*\['Strict', 'Tick'\]"):
        h.handling.decode(encode_entry(entry(event_type="Other")))


def test_a_payload_the_model_refuses_is_a_decode_error() -> None:
    h = Harness(None)
    with pytest.raises(DecodeError, match=r"(?s)does not validate as Tick.*seq"):
        h.handling.decode(encode_entry(entry(payload={"resource": "r1"})))


def test_a_validator_raising_a_non_validation_error_is_a_decode_error() -> None:
    h = Harness(None)
    with pytest.raises(DecodeError, match="does not validate as Strict: AttributeError"):
        h.handling.decode(encode_entry(entry(event_type="Strict", payload={"code": 7})))


@pytest.mark.parametrize(
    ("env", "error_type"),
    [
        (entry(event_type="Other"), "UnknownEventType"),
        (entry(event_type="Strict", payload={"code": 7}), "DecodeError"),
        (entry(payload={"resource": "r1", "seq": "x"}), "DecodeError"),
    ],
)
async def test_undecodable_entries_are_dead_lettered_then_acked(
    h: Harness, env: Envelope, error_type: str
) -> None:
    fields = encode_entry(env)
    assert await h.handling.step(delivery(fields), Fence()) is Outcome.ACK
    [letter] = await h.letters()
    assert (letter.reason, letter.error_type, letter.attempts) == ("undecodable", error_type, 0)
    assert (letter.shard, letter.entry_id, letter.original()) == (1, "1-0", fields)
    assert h.calls == [] and h.handling.tally.dead_lettered == 1


async def test_a_failing_handler_gets_a_retry_delay_from_its_policy(h: Harness) -> None:
    h.fail_with = RuntimeError("boom")
    d = delivery(encode_entry(entry()))
    first = await h.handling.step(d, Fence())
    second = await h.handling.step(d, Fence())
    assert isinstance(first, float) and 0.05 <= first <= 0.1
    assert isinstance(second, float) and 0.1 <= second <= 0.2
    assert [ctx.attempt for _, ctx in h.calls] == [1, 2]
    assert await h.letters() == []


async def test_the_last_failure_is_dead_lettered_and_acked(h: Harness) -> None:
    h.fail_with = RuntimeError("boom")
    d = delivery(encode_entry(entry()))
    steps = [await h.handling.step(d, Fence()) for _ in range(3)]
    assert steps[2] is Outcome.ACK
    [letter] = await h.letters()
    assert (letter.reason, letter.error_type, letter.error, letter.attempts) == (
        "failed",
        "RuntimeError",
        "boom",
        3,
    )
    assert await h.redis.hgetall(PARKED) == {}  # on_failure="continue": nothing parked


async def test_park_dead_letters_then_holds_back_the_resource(fake_redis: Any) -> None:
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold()
    h.fail_with = RuntimeError("boom")
    assert await h.handling.step(delivery(encode_entry(entry()), 1), Fence()) is Outcome.ACK
    h.fail_with = None
    later = delivery(encode_entry(entry(payload={"resource": "r1", "seq": 2})), 2)
    other = delivery(encode_entry(entry(rid="r2", payload={"resource": "r2", "seq": 1})), 3)
    assert await h.handling.step(later, Fence()) is Outcome.ACK
    assert await h.handling.step(other, Fence()) is Outcome.ACK
    letters = await h.letters()
    assert [(x.entry_id, x.reason, x.resource_id) for x in letters] == [
        ("1-0", "failed", "r1"),
        ("2-0", "parked", "r1"),
    ]
    assert await fake_redis.hgetall(PARKED) == {b"r1": letters[0].dlq_id.encode()}
    assert [e.resource for e, _ in h.calls] == ["r1", "r2"]  # r1's first attempt, then r2
    assert h.fenced_off == []


async def test_an_unpark_control_entry_replays_the_parked_letters_in_order(
    fake_redis: Any,
) -> None:
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold()
    h.fail_with = RuntimeError("boom")
    await h.handling.step(delivery(encode_entry(entry()), 1), Fence())
    h.fail_with = None
    seq2 = encode_entry(entry(payload={"resource": "r1", "seq": 2}))
    await h.handling.step(delivery(seq2, 2), Fence())
    h.calls.clear()
    # as `eventbus dlq requeue` does: record the request, then send its nonce
    await fake_redis.hsetnx(
        KEYS.control("orders", "g"), "n1", control_request("__eventbus.unpark", "r1")
    )
    control = delivery(control_entry("__eventbus.unpark", "r1", "g", nonce="n1"), 3)
    assert await h.handling.step(control, Fence()) is Outcome.ACK
    assert [e.seq for e, _ in h.calls] == [1, 2]
    assert [ctx.entry_id for _, ctx in h.calls] == ["1-0", "2-0"]  # the original entry IDs
    assert await h.letters() == [] and await fake_redis.hgetall(PARKED) == {}


async def test_an_unpark_replays_the_letters_when_the_parked_value_is_not_utf8(
    fake_redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Another client wrote a value that is not UTF-8 (so no dead-letter ID) for r1 in the
    parked hash: the operator's unpark still replays r1's letters, looked up from the start of
    the dead-letter stream, and says so at WARNING naming the key and the field."""
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold()
    h.fail_with = RuntimeError("boom")
    await h.handling.step(delivery(encode_entry(entry()), 1), Fence())
    h.fail_with = None
    await h.handling.step(
        delivery(encode_entry(entry(payload={"resource": "r1", "seq": 2})), 2), Fence()
    )
    await fake_redis.hset(PARKED, "r1", b"\xff\xfe")
    h.calls.clear()
    await fake_redis.hsetnx(
        KEYS.control("orders", "g"), "n1", control_request("__eventbus.unpark", "r1")
    )
    control = delivery(control_entry("__eventbus.unpark", "r1", "g", nonce="n1"), 3)
    with caplog.at_level(logging.WARNING, "eventbus.consumer"):
        assert await h.handling.step(control, Fence()) is Outcome.ACK
    assert [e.seq for e, _ in h.calls] == [1, 2]
    assert await h.letters() == [] and await fake_redis.hgetall(PARKED) == {}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(PARKED in m and "'r1'" in m and "not UTF-8" in m for m in warned), warned


@pytest.mark.parametrize(
    ("owner", "token"), [("c-2", 8), ("c-1", 8), (None, 7)], ids=["taken", "retaken", "released"]
)
async def test_a_park_is_refused_by_redis_once_the_shard_lock_moved_on(
    fake_redis: Any, owner: str | None, token: int
) -> None:
    """The client's fence passes (a process paused after its lease check), but the shard's lock
    in Redis has another owner, a newer token, or none: the park is not written, the entry is
    let go unacked (its new owner handles it), and this process does not hold the resource
    back; the consumer is told (it drops the shard)."""
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    if owner is not None:
        await h.hold(owner, token)
    h.fail_with = RuntimeError("boom")
    d = delivery(encode_entry(entry()), 1)
    assert await h.handling.step(d, Fence()) is Outcome.LET_GO
    assert await fake_redis.hgetall(PARKED) == {}
    assert not h.handling.failures.is_parked("r1")
    assert h.fenced_off == [d]


async def test_an_unpark_is_refused_by_redis_once_the_shard_lock_moved_on(
    fake_redis: Any,
) -> None:
    """The operator's requeue runs (the letters replay), but the shard's lock was taken by
    another consumer before the unpark: the resource stays parked in Redis, the request stays
    recorded, and the control entry is let go unacked for the new owner to finish."""
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold()
    h.fail_with = RuntimeError("boom")
    await h.handling.step(delivery(encode_entry(entry()), 1), Fence())
    h.fail_with = None
    request = control_request("__eventbus.unpark", "r1")
    await fake_redis.hsetnx(KEYS.control("orders", "g"), "n1", request)
    await h.hold("c-2", 8)  # another consumer took shard 1
    control = delivery(control_entry("__eventbus.unpark", "r1", "g", nonce="n1"), 3)
    assert await h.handling.step(control, Fence()) is Outcome.LET_GO
    assert list(await fake_redis.hgetall(PARKED)) == [b"r1"]
    assert await fake_redis.hget(KEYS.control("orders", "g"), "n1") == request
    assert h.fenced_off == [control]


async def test_a_refused_park_deletes_its_own_dead_letter(fake_redis: Any) -> None:
    """A consumer whose lock moved on wrote its letter (the XADD is fenced by the
    client only) and is refused the park: its letter is deleted, since the new owner handles
    the entry again; left, a requeue would replay it after the owner's later letters."""
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold("c-2", 8)
    h.fail_with = RuntimeError("boom")
    assert await h.handling.step(delivery(encode_entry(entry()), 1), Fence()) is Outcome.LET_GO
    assert await h.letters() == []


async def test_a_requeue_passes_over_a_late_letter_of_an_earlier_entry(fake_redis: Any) -> None:
    """The owner parked r1 at its letter of entry 5-0 (seq 2); then a letter of
    entry 1-0 (seq 1, which the owner had handled) lands, written late by a consumer that had
    lost the shard and never got to delete it. A requeue replays seq 2 only, not seq 2 then 1."""
    h = Harness(fake_redis, on_failure="park", max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    await h.hold()
    h.fail_with = RuntimeError("boom")
    later = encode_entry(entry(payload={"resource": "r1", "seq": 2}))
    assert await h.handling.step(delivery(later, 5), Fence()) is Outcome.ACK
    earlier = encode_entry(entry(payload={"resource": "r1", "seq": 1}))
    stale = dead_letter_fields(
        topic="orders",
        group="g",
        shard=1,
        entry_id=b"1-0",
        reason="failed",
        exc=RuntimeError("boom"),
        attempts=1,
        original=earlier,
    )
    await fake_redis.xadd(DLQ, stale)
    h.fail_with = None
    h.calls.clear()
    await fake_redis.hsetnx(
        KEYS.control("orders", "g"), "n1", control_request("__eventbus.unpark", "r1")
    )
    control = delivery(control_entry("__eventbus.unpark", "r1", "g", nonce="n1"), 9)
    assert await h.handling.step(control, Fence()) is Outcome.ACK
    assert [e.seq for e, _ in h.calls] == [2]


async def test_a_fenced_write_applied_before_its_reply_was_lost_counts_as_done(
    fake_redis: Any,
) -> None:
    """A park applied, its reply lost with the connection, the lock moved on, and
    the retry refused: the resource is parked at this consumer's letter all the same, so the
    write is done (not let go: the new owner would dead-letter the entry a second time)."""
    h = Harness(fake_redis, on_failure="park")
    await h.hold("c-2", 8)  # the lock moved on after the first try was applied
    await fake_redis.hset(PARKED, "r1", "3-0")
    failures = h.handling.failures
    d = delivery(encode_entry(entry()), 1)
    assert await failures._fenced(d, "park", PARKED, "HSETNX", "r1", b"3-0")
    assert not await failures._fenced(d, "park", PARKED, "HSETNX", "r1", b"4-0")


async def test_a_dead_letter_is_not_written_when_the_shard_is_lost_first(h: Harness) -> None:
    """The step starts under the fence; the write's `wait` finds the shard lost: LET_GO, and
    nothing written (the next owner handles the entry)."""
    h.fail_with = RuntimeError("boom")
    sub = h.handling.sub
    sub.options = replace(sub.options, max_attempts=1, retry_base_s=0.01, retry_max_s=0.01)
    d = delivery(encode_entry(entry()))
    assert await h.handling.step(d, Fence(waits=iter([False]))) is Outcome.LET_GO
    assert await h.letters() == [] and h.handling.tally.dead_lettered == 0


async def test_dedup_window_skips_an_event_id_already_handled(fake_redis: Any) -> None:
    h = Harness(fake_redis, dedup_window_s=30.5)
    env = entry()
    assert await h.handling.step(delivery(encode_entry(env), 1), Fence()) is Outcome.ACK
    again = delivery(encode_entry(env), 2)  # the same event ID, published twice
    assert await h.handling.step(again, Fence()) is Outcome.ACK
    assert len(h.calls) == 1 and h.handling.tally.duplicates_skipped == 1
    ttl = await fake_redis.ttl(KEYS.dedup("orders", "g", env.event_id_bytes))
    assert 0 < ttl <= 31  # the window, rounded up to whole seconds


async def test_a_failed_attempt_is_not_marked_seen(fake_redis: Any) -> None:
    h = Harness(fake_redis, dedup_window_s=30)
    h.fail_with = RuntimeError("once")
    d = delivery(encode_entry(entry()))
    assert isinstance(await h.handling.step(d, Fence()), float)
    h.fail_with = None
    assert await h.handling.step(d, Fence()) is Outcome.ACK
    assert len(h.calls) == 2 and h.handling.tally.duplicates_skipped == 0


def test_skipping_many_unknown_types_warns_a_bounded_number_of_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``on_unknown="skip"``, 2,000 distinct unknown types logged 2,000
    WARNING lines and grew a set without bound: the first 100 types are named once each, the
    rest summed up in at most one WARNING a minute."""
    h = Harness(None)
    with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
        for i in range(2000):
            h.handling.decoding.skip(f"T{i}")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 101
    assert "skipped 1 more events" in warnings[-1].getMessage()
    assert len(h.handling.decoding._skipped_types) == 100
