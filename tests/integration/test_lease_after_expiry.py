"""A consumer whose liveness lapsed while another consumer took its shard over must start no
handler with the superseded fencing token once it runs again (stress/FINDINGS.md 10).

The consumer's event loop is blocked past its liveness TTL from inside a handler (as a SIGSTOP,
a starved process or a long GC pause would), and meanwhile consumer "b" takes the shard over;
then the consumer runs again, with entries of the lost shard queued. Its next liveness refresh
must not renew its lease over the shard table it had before the lapse:

* a heartbeat that runs after the lock round that revived the member, but is answered first:
  the heartbeat finds the member live, yet the shard table is the one from before the lapse
  until the lock round's reply arrives;
* a heartbeat that runs after the lapse and whose reply is lost with its connection, then the
  next heartbeat: it must not find the member live (heartbeat.lua revives no member).

The Redis calls are real; the tests only choose the order in which the replies arrive (a gate
around the registered lock scripts), which a network or a busy event loop chooses at random.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import redis
from support import Tick

from eventbus import Context, EventBus, Settings
from eventbus.consumer import running
from eventbus.locking.scripts import Scripts, source

pytestmark = pytest.mark.anyio

TTL_S = 0.6  # heartbeats every 0.2 s, lease 0.48 s
LONG_TTL_MS = 60_000


class Lapse:
    """The consumer under test ("a") on topic "t", group "g", one shard; its first event's
    handler blocks the event loop until "b" has taken the shard over."""

    def __init__(self, settings: Callable[..., Settings], redis_db: str, **overrides: Any) -> None:
        self.bus = EventBus(settings(shards=1, liveness_ttl_s=TTL_S, lock_interval_ms=60_000,
                                     **overrides))  # fmt: skip
        self.url = redis_db
        self.after = False  # set once the loop runs again after the lapse
        self.took_over_with: int | None = None
        self.runs: list[tuple[int, int, bool]] = []  # (seq, token, after the lapse)
        self._beat = anyio.Event()  # set (and replaced) whenever a heartbeat is answered
        self.bus.subscriber("t", group="g")(self.handle)

    async def handle(self, event: Tick, ctx: Context) -> None:
        self.runs.append((event.seq, ctx.fencing_token, self.after))
        if event.seq == 1:
            # right after a heartbeat's reply, so that no refresh is in flight during the stall
            await self._beat.wait()
            self.took_over_with = self._take_over()  # blocks the loop past the TTL
            self.after = True

    def _take_over(self) -> int:
        """As consumer "b", lock shard 0 as soon as "a"'s liveness has run out, polling from
        this blocked loop as another process would while this one is stopped."""
        keys = [self.bus.keys.members("t", "g"), self.bus.keys.locks("t", "g")]
        keys.append(self.bus.keys.lock_epoch("t", "g"))
        with redis.Redis.from_url(self.url) as r:
            lock = r.register_script(source("lock_shards"))
            deadline = time.monotonic() + 10 * TTL_S
            while time.monotonic() < deadline:
                reply = lock(keys=keys, args=["b", LONG_TTL_MS, 1, "", 0, "", 0])
                grants = {int(s): int(token) for s, token, _ in reply[2:]}
                if 0 in grants:
                    return grants[0]
                time.sleep(0.01)  # part of the stall: this process is "stopped"
        raise AssertionError("b never took shard 0 over")

    def gate(
        self,
        monkeypatch: pytest.MonkeyPatch,
        lock_shards: Callable[[Any, Any, Any], Awaitable[Any]] | None = None,
        heartbeat: Callable[[Any, Any, Any], Awaitable[Any]] | None = None,
    ) -> None:
        """Route the consumer's lock and heartbeat scripts through `lock_shards(real, keys,
        args)` / `heartbeat(real, keys, args)` once the loop runs again after the lapse."""

        def through(wrapper: Any, real: Any, answered: Callable[[], None] = lambda: None) -> Any:
            async def call(*, keys: Any, args: Any) -> Any:
                if not self.after or wrapper is None:
                    reply = await real(keys=keys, args=args)
                else:
                    reply = await wrapper(real, keys, args)
                answered()
                return reply

            return call

        def beat() -> None:
            self._beat.set()
            self._beat = anyio.Event()

        class Gated:
            @staticmethod
            def register(client: Any) -> Scripts:
                real = Scripts.register(client)
                return Scripts(
                    lock_shards=through(lock_shards, real.lock_shards),
                    unlock_shards=real.unlock_shards,
                    heartbeat=through(heartbeat, real.heartbeat, beat),
                )

        monkeypatch.setattr(running, "Scripts", Gated)  # the scripts its consumers share

    async def run(self, events: int, until: anyio.Event) -> None:
        """Publish `events` events of one resource, consume until `until` is set, stop."""
        stop = anyio.Event()
        try:
            async with self.bus:
                for seq in range(1, events + 1):
                    await self.bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(functools.partial(self.bus.run, stop=stop))
                        await until.wait()
                        stop.set()
        finally:
            await self.bus.aclose()

    def stale_runs(self) -> list[tuple[int, int]]:
        """Handler starts after the lapse, with their tokens: each is a start with a token that
        "b"'s takeover had superseded."""
        assert self.took_over_with is not None and self.took_over_with > 1
        return [(seq, token) for seq, token, after in self.runs if after]


async def test_a_heartbeat_answered_before_the_reviving_lock_round_renews_no_lease(
    settings: Callable[..., Settings], redis_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lapse = Lapse(settings, redis_db)
    lock_ran, release, replied, done = anyio.Event(), anyio.Event(), anyio.Event(), anyio.Event()
    beats = 0

    async def lock_shards(real: Any, keys: Any, args: Any) -> Any:
        reply = await real(keys=keys, args=args)  # revives "a": live again, shard 0 is b's
        if not lock_ran.is_set():
            lock_ran.set()
            await release.wait()  # its reply arrives after the next heartbeat's
            replied.set()
        return reply

    async def heartbeat(real: Any, keys: Any, args: Any) -> Any:
        nonlocal beats
        beats += 1
        if beats == 1:
            await lock_ran.wait()  # runs after that lock round: finds "a" live
        elif beats == 2:
            release.set()  # a heartbeat interval later: every worker it woke has run
        elif replied.is_set():
            done.set()
        return await real(keys=keys, args=args)

    lapse.gate(monkeypatch, lock_shards=lock_shards, heartbeat=heartbeat)
    await lapse.run(3, until=done)

    assert lapse.stale_runs() == []


async def test_a_heartbeat_after_one_whose_reply_was_lost_does_not_find_the_lapsed_member_live(
    settings: Callable[..., Settings], redis_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_in_flight 2 < the 3 entries read: the read loop waits for capacity and sends no lock
    # round, so only heartbeats can tell the consumer what became of its liveness
    lapse = Lapse(settings, redis_db, max_in_flight=2)
    done = anyio.Event()
    beats = 0

    async def heartbeat(real: Any, keys: Any, args: Any) -> Any:
        nonlocal beats
        beats += 1
        reply = await real(keys=keys, args=args)
        if beats == 1:  # ran on the server after the lapse; its reply is lost
            raise redis.ConnectionError("Connection closed by server.")
        if beats == 4:
            done.set()
        return reply

    lapse.gate(monkeypatch, heartbeat=heartbeat)
    await lapse.run(3, until=done)

    assert lapse.stale_runs() == []
