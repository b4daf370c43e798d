"""Coordination at fleet scale, without the data path: what the lock protocol costs Redis and how
fast the shards move to a fair share when a consumer joins, leaves or dies.

    python stress/coordination.py [--consumers 200] [--shards 4096] [--groups 1]
        [--processes 2] [--lock-interval-ms 100] [--ttl-s 5] [--steady-s 10] [--json F]

On a private ``redis-server``, `--processes` worker processes run `--consumers` members of each of
`--groups` groups of one topic as anyio tasks, with the library's own lock client
(`eventbus.locking.locks.LockClient`, ``lua/lock_shards.lua``) and heartbeat loop
(`eventbus.locking.lease.heartbeat_loop`). Each member does what a busy consumer does for
coordination: a lock round (`LockClient.poll`) every `--lock-interval-ms` over every shard (in
its rotating order of preference), its surplus above the fair share released at once (a
draining shard with nothing in flight), a heartbeat every TTL / 3. No stream is read.

It reports, per group count and shape:

* ``redis_cpu_percent_steady``: the Redis server's CPU (``INFO cpu`` user + sys) over
  `--steady-s` seconds once every group has a fair share, as % of one core;
* ``commands_per_s`` and ``top_commands`` (``INFO commandstats``, calls per second, the same
  window; the script's own commands count under ``evalsha`` and the commands it calls);
* ``rebalance_s_join`` / ``_leave`` / ``_kill``: seconds from a member joining, leaving
  gracefully (``unlock_shards`` with leave), or its process being SIGKILLed until group 0 has a
  fair share again (``kill``: the TTL's expiry included);
* ``moves_per_change``: shards whose owner differs before the change and at that fair share;
* ``unowned_samples``: samples, once fair, in which a shard had no live owner (should be 0
  outside a kill).

A fair share: every shard's lock held by a live member, each member holding ``floor(shards /
members)`` or ``ceil(shards / members)`` (the shares ``lock_shards.lua`` grants). Samples are
one ``HGETALL`` of the lock hash and one ``ZRANGE`` of the members every 50 ms, taken outside the
steady window.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import redis

from eventbus.config import Settings
from eventbus.locking.lease import heartbeat_loop
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys
from localredis.server import RedisServer

TOPIC = "fleet"


async def member_loop(member: Member, shards: int, interval_s: float, stop: anyio.Event) -> None:
    """One member's coordination until `stop`: lock rounds, surplus released, heartbeats; then
    a graceful leave (its locks released, out of the live members)."""
    locks = LockClient(member, shards=shards, scripts=Scripts.register(member.redis))
    joined = anyio.Event()
    held: set[int] = set()
    rotation = hash(member.consumer_id) % shards

    def expired() -> None:
        held.clear()

    async with anyio.create_task_group() as tg:
        ttl = member.settings.liveness_ttl_s
        tg.start_soon(heartbeat_loop, locks, ttl, joined, None, expired)
        while not stop.is_set():
            # as the consumer's lock round (`Ownership.lock_round`, under a valid lease)
            got = await locks.poll([(rotation + i) % shards for i in range(shards)])
            rotation = (rotation + 1) % shards
            joined.set()
            held = set(got.grants)
            surplus = len(held) - got.share
            if surplus > 0:
                for s in await locks.release(sorted(held)[-surplus:]):
                    held.discard(s)
            with anyio.move_on_after(interval_s):
                await stop.wait()
        tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True):
        await locks.release(held, leave=True)


async def worker_main(url: str, settings: dict[str, Any], shards: int, conn: Connection) -> None:
    """A worker process: runs the members the parent names on `conn` (``("join", group, id)``,
    ``("leave", group, id)``, ``("stop",)``), acknowledging each command with ``"ok"``."""
    import redis.asyncio

    s = Settings(redis_url=url, **settings)
    client = redis.asyncio.Redis.from_url(url, max_connections=None)
    keys = Keys()
    interval_s = s.lock_interval_ms / 1000
    stops: dict[tuple[str, str], anyio.Event] = {}
    async with client, anyio.create_task_group() as tg:
        while True:
            cmd = await anyio.to_thread.run_sync(conn.recv)
            if cmd[0] == "stop":
                for ev in stops.values():
                    ev.set()
                break
            _, group, member_id = cmd
            if cmd[0] == "join":
                stop = stops[(group, member_id)] = anyio.Event()
                m = Member(client, keys, s, TOPIC, group, member_id, EVENTBUS)
                tg.start_soon(member_loop, m, shards, interval_s, stop)
            else:
                stops.pop((group, member_id)).set()
            conn.send("ok")
    conn.send("ok")


def worker(url: str, settings: dict[str, Any], shards: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers
    anyio.run(worker_main, url, settings, shards, conn)


class Fleet:
    """The worker processes and the members each runs (parent side)."""

    def __init__(self, url: str, settings: dict[str, Any], shards: int, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(url, settings, shards, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.where: dict[tuple[str, str], int] = {}
        self._next = 0

    def _send(self, i: int, cmd: tuple[str, ...]) -> None:
        self.conns[i].send(cmd)
        assert self.conns[i].recv() == "ok"

    def join(self, group: str, member_id: str, process: int | None = None) -> None:
        i = self._next % len(self.conns) if process is None else process
        self._next += 1
        self.where[(group, member_id)] = i
        self._send(i, ("join", group, member_id))

    def leave(self, group: str, member_id: str) -> None:
        self._send(self.where.pop((group, member_id)), ("leave", group, member_id))

    def kill(self, process: int) -> None:
        os.kill(self.procs[process].pid, signal.SIGKILL)
        self.procs[process].join()

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                self._send(i, ("stop",))
                p.join(timeout=30)


def fair(
    r: Any, keys: Keys, group: str, shards: int, gone: str = "", joined: str = ""
) -> tuple[bool, dict[int, str], int]:
    """Whether `group` has a fair share now (member `gone`, one that left or was killed, out of
    it; member `joined` in it), its owners (shard -> member ID), and how many shards have no
    live owner."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.locks(TOPIC, group))
    pipe.zrangebyscore(keys.members(TOPIC, group), "(" + str(server_ms(r)), "+inf")
    raw, live_raw = pipe.execute()
    live = {m.decode() for m in live_raw} - {gone}
    owners = {int(k): v.decode() for k, v in raw.items() if k.isdigit()}
    unowned = sum(1 for s in range(shards) if owners.get(s) not in live)
    if not live or (joined and joined not in live):  # (a join is sent, not yet made)
        return False, owners, unowned
    counts = Counter(o for o in owners.values() if o in live)
    # each live member holds floor(S / N) or ceil(S / N): nobody starves, nobody hogs
    least, most = shards // len(live), math.ceil(shards / len(live))
    spread = [counts.get(m, 0) for m in live]
    return unowned == 0 and least <= min(spread) and max(spread) <= most, owners, unowned


def server_ms(r: Any) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def until_fair(
    r: Any,
    keys: Keys,
    group: str,
    shards: int,
    timeout_s: float,
    gone: str = "",
    joined: str = "",
) -> tuple[float, dict[int, str]]:
    """Seconds until `group` has a fair share without member `gone` and with member `joined`
    (sampled every 50 ms), and its owners then."""
    start = time.monotonic()
    while True:
        ok, owners, _ = fair(r, keys, group, shards, gone, joined)
        if ok:
            return time.monotonic() - start, owners
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"group {group}: no fair share after {timeout_s} s")
        time.sleep(0.05)


def moved(before: dict[int, str], after: dict[int, str]) -> int:
    return sum(1 for s, owner in after.items() if before.get(s) != owner)


def cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_calls(r: Any) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    keys = Keys()
    settings = {"liveness_ttl_s": args.ttl_s, "lock_interval_ms": args.lock_interval_ms}
    groups = [f"g{g}" for g in range(args.groups)]
    r: Any = redis.Redis.from_url(url)
    fleet = Fleet(url, settings, args.shards, args.processes)
    # the member that will be SIGKILLed has a process of its own
    victim_process = Fleet(url, settings, args.shards, 1)
    timeout_s = 60 + 4 * args.ttl_s
    result: dict[str, Any] = {
        "consumers": args.consumers,
        "shards": args.shards,
        "groups": args.groups,
        "processes": args.processes,
        "lock_interval_ms": args.lock_interval_ms,
        "ttl_s": args.ttl_s,
    }
    try:
        for g in groups:
            for m in range(args.consumers - 1):
                fleet.join(g, f"{g}-m{m}")
        victim_process.join(groups[0], "victim", process=0)
        start = time.monotonic()
        for g in groups:
            until_fair(r, keys, g, args.shards, timeout_s)
        result["first_fair_share_s"] = time.monotonic() - start

        time.sleep(2 * args.lock_interval_ms / 1000)  # the rounds after the first fair share
        calls0, cpu0, t0 = command_calls(r), cpu_s(r), time.monotonic()
        time.sleep(args.steady_s)
        calls1, cpu1, wall = command_calls(r), cpu_s(r), time.monotonic() - t0
        per_s = {k: (calls1[k] - calls0.get(k, 0)) / wall for k in calls1}
        result["redis_cpu_percent_steady"] = round(100 * (cpu1 - cpu0) / wall, 2)
        result["commands_per_s"] = round(sum(per_s.values()), 1)
        top = sorted(per_s.items(), key=lambda kv: -kv[1])[:8]
        result["top_commands"] = {k: round(v, 1) for k, v in top if v > 0}

        unowned = 0
        for _ in range(10):
            unowned += fair(r, keys, groups[0], args.shards)[2] > 0
            time.sleep(0.05)
        result["unowned_samples"] = unowned

        changes = []
        g0 = groups[0]
        _, before = until_fair(r, keys, g0, args.shards, timeout_s)
        fleet.join(g0, f"{g0}-joiner")
        join_s, after = until_fair(r, keys, g0, args.shards, timeout_s, joined=f"{g0}-joiner")
        result["rebalance_s_join"] = round(join_s, 3)
        changes.append(moved(before, after))

        before = after
        fleet.leave(g0, f"{g0}-joiner")
        leave_s, after = until_fair(r, keys, g0, args.shards, timeout_s, f"{g0}-joiner")
        result["rebalance_s_leave"] = round(leave_s, 3)
        changes.append(moved(before, after))

        before = after
        victim_process.kill(0)
        kill_s, after = until_fair(r, keys, g0, args.shards, timeout_s, "victim")
        result["rebalance_s_kill"] = round(kill_s, 3)
        result["rebalance_s_kill_after_ttl"] = round(kill_s - args.ttl_s, 3)
        changes.append(moved(before, after))
        result["moves_per_change"] = changes
    finally:
        fleet.close()
        victim_process.close()
        r.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--consumers", type=int, default=200, help="members per group")
    p.add_argument("--shards", type=int, default=4096)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--processes", type=int, default=2, help="worker processes for the members")
    p.add_argument("--lock-interval-ms", type=int, default=100)
    p.add_argument("--ttl-s", type=float, default=5.0, help="liveness TTL (seconds)")
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with RedisServer() as server:
        res = measure(a, server.url)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
