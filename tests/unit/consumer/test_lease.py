"""The lease and its heartbeats (`eventbus.locking.lease`), with a fake lock client: no Redis."""

from __future__ import annotations

import logging
import time

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from eventbus.locking.lease import FailureLog, Lease, heartbeat_loop

pytestmark = pytest.mark.anyio


def test_a_new_lease_is_not_valid() -> None:
    lease = Lease(1.0)
    assert not lease.ok() and lease.remaining_ms() < 0


def test_renew_counts_from_the_send_time_and_never_shortens() -> None:
    lease = Lease(10.0)
    now = time.monotonic()
    lease.renew(now - 9.0)  # a reply to a request sent 9 s ago: 1 s left
    assert lease.ok() and 0 < lease.remaining_ms() <= 1000
    lease.renew(now)
    assert 9_000 < lease.remaining_ms() <= 10_000
    lease.renew(now - 5.0)  # a late reply to an older request does not shorten it
    assert lease.remaining_ms() > 9_000
    lease.renew(now - 20.0)
    assert lease.ok()


def test_renew_from_long_ago_leaves_no_lease() -> None:
    lease = Lease(1.0)
    lease.renew(time.monotonic() - 2.0)
    assert not lease.ok()


async def test_changed_wakes_every_waiter_on_renew_or_wake() -> None:
    lease = Lease(1.0)
    woke: list[int] = []

    async def waiter(n: int) -> None:
        await lease.changed()
        woke.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(waiter, n)
        await anyio.lowlevel.checkpoint()
        lease.renew(time.monotonic())
    assert sorted(woke) == [0, 1, 2]
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 3)
        await anyio.lowlevel.checkpoint()
        lease.wake()
    assert woke[-1] == 3


class FakeLocks:
    """`heartbeat()` answers from `replies` (a bool: was the member live; an exception: raised);
    `done` is set once they are used up, and later calls wait until cancelled (a retry 3 ms
    after the last failure could come before the test cancels the loop: an IndexError under
    load). `acquiring`: a lock round is in flight."""

    member_id = "c-1"

    def __init__(self, *replies: bool | Exception, acquiring: bool = False) -> None:
        self.replies = list(replies)
        self.calls = 0
        self.done = anyio.Event()
        self.acquiring = acquiring

    async def heartbeat(self) -> bool:
        if not self.replies:  # used up: the test is ending; a slow machine may call once more
            await anyio.sleep_forever()
        self.calls += 1
        reply = self.replies.pop(0)
        if not self.replies:
            self.done.set()
        if isinstance(reply, Exception):
            raise reply
        return reply


async def run_heartbeats(locks: FakeLocks, lease: Lease, joined: anyio.Event) -> list[str]:
    expired: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            heartbeat_loop, locks, 0.03, joined, lease.renew, lambda: expired.append("expired")
        )
        joined.set()
        with anyio.fail_after(5):
            await locks.done.wait()
        await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    return expired


async def test_heartbeats_wait_for_the_first_lock_round() -> None:
    locks = FakeLocks(True)
    joined = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat_loop, locks, 0.03, joined, Lease(1.0).renew, lambda: None)
        await anyio.sleep(0.05)  # longer than a heartbeat period
        assert locks.calls == 0
        joined.set()
        with anyio.fail_after(5):
            await locks.done.wait()
        tg.cancel_scope.cancel()


async def test_heartbeats_renew_the_lease_and_report_an_expired_liveness() -> None:
    lease = Lease(10.0)
    locks = FakeLocks(True, False, True)
    expired = await run_heartbeats(locks, lease, anyio.Event())
    assert expired == ["expired"]
    assert lease.ok() and lease.remaining_ms() > 9_000


async def test_a_heartbeat_that_finds_the_liveness_expired_renews_nothing() -> None:
    lease = Lease(10.0)
    expired = await run_heartbeats(FakeLocks(False), lease, anyio.Event())
    assert expired == ["expired"] and not lease.ok()


async def test_a_heartbeat_answered_while_a_lock_round_is_in_flight_renews_nothing() -> None:
    """That round may have made the member live again after a lapse (so the heartbeat finds it
    live) while the shards the consumer holds are those from before the lapse until the round's
    reply is applied; the round renews the lease itself (stress/FINDINGS.md 10)."""
    lease = Lease(10.0)
    expired = await run_heartbeats(FakeLocks(True, True, acquiring=True), lease, anyio.Event())
    assert expired == [] and not lease.ok()


async def test_a_failed_heartbeat_is_retried_and_does_not_renew() -> None:
    lease = Lease(10.0)
    locks = FakeLocks(RedisConnectionError("down"), OSError("reset"), True)
    expired = await run_heartbeats(locks, lease, anyio.Event())
    assert expired == [] and locks.calls == 3
    assert lease.ok()  # renewed by the third, successful heartbeat only


async def test_failures_alone_never_renew() -> None:
    lease = Lease(10.0)
    locks = FakeLocks(RedisConnectionError("down"), RedisConnectionError("down"))
    await run_heartbeats(locks, lease, anyio.Event())
    assert not lease.ok()


async def test_without_a_lease_heartbeats_report_an_expired_liveness_and_retry_failures() -> None:
    """The offloader's use: no lease to renew (`on_live` None); a lapse is still reported, a
    failure retried."""
    locks = FakeLocks(True, RedisConnectionError("down"), False, True)
    expired: list[str] = []
    joined = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat_loop, locks, 0.03, joined, None, lambda: expired.append("x"))
        joined.set()
        with anyio.fail_after(5):
            await locks.done.wait()
        tg.cancel_scope.cancel()
    assert expired == ["x"] and locks.calls == 4


def test_a_run_of_failures_is_logged_at_warning_once_then_at_most_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Redis outage fails a heartbeat every TTL/10: the first failure is a WARNING, then at
    most one per `every_s` with the count of failures not logged; the recovery is one INFO; a
    new outage starts a new run."""
    now = [100.0]
    failures = FailureLog("c-1", every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="eventbus.locking"):
        for _ in range(30):  # 30 failures, 1 s apart: t = 100 .. 129
            failures.failed(RedisConnectionError("down"))
            now[0] += 1.0
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert "c-1: heartbeat failed: down" in caplog.records[0].getMessage()
        failures.failed(RedisConnectionError("still down"))  # t = 130: 30 s after the first
        failures.failed(RedisConnectionError("still down"))  # t = 130 again: not logged
        now[0] = 135.0
        failures.succeeded()
        failures.succeeded()  # logged once
        failures.failed(OSError("reset"))  # a new outage
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.WARNING, logging.INFO, logging.WARNING]
    again, recovered, new = (r.getMessage() for r in caplog.records[1:])
    assert "still down" in again and "failing for 30.0 s, 31 failures; 29 not logged" in again
    assert recovered == "c-1: heartbeat answered again after 32 failed in 35.0 s"
    assert "c-1: heartbeat failed: reset" in new


def test_a_negative_log_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="every_s must be >= 0 seconds, got -1"):
        FailureLog("c-1", every_s=-1)
