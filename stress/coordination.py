"""Coordination at fleet scale, without the data path: what the lock protocol costs Redis and how
fast the shards move to a fair share when a consumer joins, leaves or dies.

    python stress/coordination.py [--consumers 200] [--shards 4096] [--groups 1]
        [--processes 2] [--lock-interval-ms 100] [--ttl-s 5] [--steady-s 10] [--json F]
        [--coordination-slots shared|topic] [--owed-interval-ms N] [--trace]

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
  fair share again (``kill``: the TTL's expiry included; ``_kill_after_deadline``: from the
  victim's liveness deadline, its last refresh + TTL, which comes up to TTL / 3 before kill +
  TTL);
* ``moves_per_change``: shards whose owner differs before the change and at that fair share;
* ``unowned_samples``: samples, once fair, in which a shard had no live owner (should be 0
  outside a kill);
* ``rounds_per_s`` against ``rounds_per_s_asked`` (members x 1,000 / `--lock-interval-ms`): the
  lock rounds the members made in the steady window; ``workers_cpu_percent`` (the worker
  processes' CPU, % of one core) and ``round_late_ms_steady`` (p50/p99/max of how late a round
  started after it was due) say whether the workers were short of CPU;
  ``redis_us_per_round`` and ``redis_cpu_percent_at_full_rate`` (the steady CPU scaled to the
  asked rounds) answer the CPU target honestly when they were;
* ``rebalance_detail``: per change, the Redis CPU it took, the ``EVALSHA`` calls (lock and
  unlock scripts) and their µs, when the joiner first held a shard, and how late rounds were;
  with ``--trace``, ``rebalance_trace``: each member round that changed its share or locks, and
  each release, in seconds from the change.

A fair share: every shard's lock held by a live member, each member holding ``floor(shards /
members)`` or ``ceil(shards / members)`` (the shares ``lock_shards.lua`` grants). Samples are
one ``HGETALL`` of the lock hash and one ``ZRANGE`` of the members every 20 ms (`SAMPLE_S`),
taken outside the steady window.
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


ROUNDS = [0]
"""Lock rounds (`LockClient.poll` calls answered) of this worker process's members so far."""
LATE_MS: list[float] = []
"""How late each lock round of this worker's members started (ms after it was due): the worker's
own CPU starvation, which delays rebalancing as much as Redis would."""
EVENTS: list[tuple[float, str, str, int, int]] = []
"""What changed for this worker's members, for `rebalance_trace`: (wall-clock s, member, what
("round": the share or held locks changed, "free": surplus released), share, locks held)."""


async def member_loop(
    member: Member,
    shards: int,
    interval_s: float,
    stop: anyio.Event,
    every: list[int],
    owed_interval_s: float = 0.0,
) -> None:
    """One member's coordination until `stop`: lock rounds, surplus released, heartbeats; then
    a graceful leave (its locks released, out of the live members). `every` is ``range(shards)``
    twice: a rotation of the shards is one slice of it, not a 4,096-element list comprehension
    per round (the workers are short of CPU at 200 members). With `owed_interval_s`, a member
    owed shards (`LockClient.owed`) makes its next round after that instead of `interval_s`
    (``--owed-interval-ms``, by default a quarter interval: what the consumer does)."""
    locks = LockClient(member, shards=shards, scripts=Scripts.register(member.redis))
    joined = anyio.Event()
    held: set[int] = set()
    share = -1
    rotation = hash(member.consumer_id) % shards

    def expired() -> None:
        held.clear()

    async with anyio.create_task_group() as tg:
        ttl = member.settings.liveness_ttl_s
        tg.start_soon(heartbeat_loop, locks, ttl, joined, None, expired)
        due = time.monotonic()
        while not stop.is_set():
            # as the consumer's lock round (`Ownership.lock_round`, under a valid lease): due
            # `interval_s` after the previous one started
            now = time.monotonic()
            LATE_MS.append(1000 * (now - due))
            due = now + interval_s
            before = (len(held), share)
            got = await locks.poll(every[rotation : rotation + shards])
            if owed_interval_s and locks.owed:
                due = now + owed_interval_s
            ROUNDS[0] += 1
            rotation = (rotation + 1) % shards
            joined.set()
            held, share = set(got.grants), got.share
            if (len(held), share) != before:
                EVENTS.append((time.time(), member.consumer_id, "round", share, len(held)))
            surplus = len(held) - got.share
            if surplus > 0:
                for s in await locks.release(sorted(held)[-surplus:]):
                    held.discard(s)
                EVENTS.append((time.time(), member.consumer_id, "free", share, len(held)))
            with anyio.move_on_after(due - time.monotonic()):
                await stop.wait()
        tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True):
        await locks.release(held, leave=True)


async def worker_main(url: str, settings: dict[str, Any], shards: int, conn: Connection) -> None:
    """A worker process: runs the members the parent names on `conn` (``("join", group, id)``,
    ``("leave", group, id)``, ``("stop",)``), acknowledging each command with ``"ok"``; to
    ``("rounds",)`` it answers its members' lock rounds so far (`ROUNDS`)."""
    import redis.asyncio

    settings = dict(settings)  # (the simulator's own knob is no setting of the library)
    owed_interval_s = settings.pop("owed_interval_ms", 0) / 1000
    s = Settings(redis_url=url, **settings)
    client = redis.asyncio.Redis.from_url(url, max_connections=None)
    keys = Keys.of(s)
    interval_s = s.lock_interval_ms / 1000
    stops: dict[tuple[str, str], anyio.Event] = {}
    every = list(range(shards)) * 2
    async with client, anyio.create_task_group() as tg:
        while True:
            cmd = await anyio.to_thread.run_sync(conn.recv)
            if cmd[0] == "stop":
                for ev in stops.values():
                    ev.set()
                break
            if cmd[0] == "rounds":
                conn.send(ROUNDS[0])
                continue
            if cmd[0] == "late":
                conn.send(LATE_MS[:])
                LATE_MS.clear()
                continue
            if cmd[0] == "events":
                conn.send(EVENTS[:])
                EVENTS.clear()
                continue
            _, group, member_id = cmd
            if cmd[0] == "join":
                stop = stops[(group, member_id)] = anyio.Event()
                m = Member(client, keys, s, TOPIC, group, member_id, EVENTBUS)
                tg.start_soon(member_loop, m, shards, interval_s, stop, every, owed_interval_s)
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

    def rounds(self) -> int:
        """Lock rounds made so far by the members of every live worker."""
        total = 0
        for conn, p in zip(self.conns, self.procs, strict=True):
            if p.is_alive():
                conn.send(("rounds",))
                total += conn.recv()
        return total

    def events(self) -> list[tuple[float, str, str, int, int]]:
        """The live workers' `EVENTS` since the last call, in time order."""
        out = []
        for conn, p in zip(self.conns, self.procs, strict=True):
            if p.is_alive():
                conn.send(("events",))
                out += conn.recv()
        return sorted(out)

    def late_ms(self) -> list[float]:
        """How late the live workers' lock rounds started since the last call (`LATE_MS`)."""
        out = []
        for conn, p in zip(self.conns, self.procs, strict=True):
            if p.is_alive():
                conn.send(("late",))
                out += conn.recv()
        return out

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the live workers so far (``/proc/<pid>/stat``)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self.procs:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
        return total

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
) -> tuple[float, dict[int, str], float | None]:
    """Seconds until `group` has a fair share without member `gone` and with member `joined`
    (sampled every `SAMPLE_S`), its owners then, and the seconds until `joined` first held a
    shard (None without `joined`)."""
    start = time.monotonic()
    first = None
    while True:
        ok, owners, _ = fair(r, keys, group, shards, gone, joined)
        if joined and first is None and joined in owners.values():
            first = time.monotonic() - start
        if ok:
            return time.monotonic() - start, owners, first
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"group {group}: no fair share after {timeout_s} s")
        time.sleep(SAMPLE_S)


SAMPLE_S = 0.02
"""Seconds between two samples of the lock hash while waiting for a fair share."""


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of `values` (ms), rounded; zeros when empty."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    v = sorted(values)
    return {
        k: round(v[min(len(v) - 1, int(q * len(v)))], 1)
        for k, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))
    }


def moved(before: dict[int, str], after: dict[int, str]) -> int:
    return sum(1 for s, owner in after.items() if before.get(s) != owner)


def cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_stats(r: Any) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: command -> (calls, µs of Redis CPU) so far."""
    return {
        k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for k, v in r.info("commandstats").items()
    }


def stats_between(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], command: str
) -> tuple[int, int]:
    """Calls and µs of `command` between two `command_stats`."""
    c0, u0 = before.get(command, (0, 0))
    c1, u1 = after.get(command, (0, 0))
    return c1 - c0, u1 - u0


def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    keys = Keys(slots=args.coordination_slots)
    settings = {
        "liveness_ttl_s": args.ttl_s,
        "lock_interval_ms": args.lock_interval_ms,
        "coordination_slots": args.coordination_slots,
        "owed_interval_ms": args.owed_interval_ms,
    }
    groups = [f"g{g}" for g in range(args.groups)]
    r: Any = redis.Redis.from_url(url)
    fleet = Fleet(url, settings, args.shards, args.processes)
    # the member that will be SIGKILLed has a process of its own
    victim_process = Fleet(url, settings, args.shards, 1)
    timeout_s = 60 + 4 * args.ttl_s
    asked = args.groups * args.consumers * 1000 / args.lock_interval_ms
    result: dict[str, Any] = {
        "consumers": args.consumers,
        "shards": args.shards,
        "groups": args.groups,
        "processes": args.processes,
        "coordination_slots": args.coordination_slots,
        "lock_interval_ms": args.lock_interval_ms,
        "ttl_s": args.ttl_s,
        "owed_interval_ms": args.owed_interval_ms,
        "load_average": list(os.getloadavg()),
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
        stats0, cpu0, t0 = command_stats(r), cpu_s(r), time.monotonic()
        rounds0, workers0 = fleet.rounds() + victim_process.rounds(), fleet.cpu_s()
        fleet.late_ms()
        time.sleep(args.steady_s)
        stats1, cpu1, wall = command_stats(r), cpu_s(r), time.monotonic() - t0
        rounds1, workers1 = fleet.rounds() + victim_process.rounds(), fleet.cpu_s()
        per_s = {k: stats_between(stats0, stats1, k)[0] / wall for k in stats1}
        cpu_percent = 100 * (cpu1 - cpu0) / wall
        result["redis_cpu_percent_steady"] = round(cpu_percent, 2)
        result["commands_per_s"] = round(sum(per_s.values()), 1)
        top = sorted(per_s.items(), key=lambda kv: -kv[1])[:8]
        result["top_commands"] = {k: round(v, 1) for k, v in top if v > 0}
        # what the members achieved of the rounds the lock interval asks: below it, the workers
        # are short of CPU, and Redis would do proportionally more at the full rate
        rounds_per_s = (rounds1 - rounds0) / wall
        result["rounds_per_s"] = round(rounds_per_s, 1)
        result["rounds_per_s_asked"] = round(asked, 1)
        result["redis_us_per_round"] = round(1e6 * (cpu1 - cpu0) / max(rounds1 - rounds0, 1), 1)
        result["redis_cpu_percent_at_full_rate"] = round(
            cpu_percent * asked / max(rounds_per_s, 1e-9), 2
        )
        result["workers_cpu_percent"] = round(100 * (workers1 - workers0) / wall, 1)
        result["round_late_ms_steady"] = percentiles(fleet.late_ms())
        calls, usec = stats_between(stats0, stats1, "evalsha")
        result["evalsha_us_per_call_steady"] = round(usec / calls, 1) if calls else None

        unowned = 0
        for _ in range(10):
            unowned += fair(r, keys, groups[0], args.shards)[2] > 0
            time.sleep(0.05)
        result["unowned_samples"] = unowned

        changes: list[int] = []
        where: dict[str, dict[str, Any]] = {}
        trace: dict[str, list[Any]] = {}
        g0 = groups[0]
        _, before, _ = until_fair(r, keys, g0, args.shards, timeout_s)

        def change(kind: str, act: Any, gone: str = "", joined: str = "") -> None:
            # where the rebalance's time goes: the Redis CPU it took, the lock scripts it ran
            # (calls, µs each), and when the joiner first held a shard
            nonlocal before
            fleet.events(), fleet.late_ms()
            s0, c0, t0 = command_stats(r), cpu_s(r), time.time()
            act()
            took, after, first = until_fair(r, keys, g0, args.shards, timeout_s, gone, joined)
            s1, c1 = command_stats(r), cpu_s(r)
            if args.trace:
                trace[kind] = [
                    [round(t - t0, 4), *rest] for t, *rest in fleet.events() if t < t0 + took + 1
                ]
            result[f"rebalance_s_{kind}"] = round(took, 3)
            calls, usec = stats_between(s0, s1, "evalsha")
            detail: dict[str, Any] = {
                "redis_cpu_s": round(c1 - c0, 3),
                "evalsha_calls": calls,
                "evalsha_us_per_call": round(usec / calls, 1) if calls else None,
                "evalsha_s": round(usec / 1e6, 3),
            }
            if first is not None:
                detail["joiner_first_shard_s"] = round(first, 3)
            detail["round_late_ms"] = percentiles(fleet.late_ms())
            where[kind] = detail
            changes.append(moved(before, after))
            before = after

        change("join", lambda: fleet.join(g0, f"{g0}-joiner"), joined=f"{g0}-joiner")
        change("leave", lambda: fleet.leave(g0, f"{g0}-joiner"), gone=f"{g0}-joiner")
        # the victim's liveness ends at its deadline (its last refresh + TTL), up to TTL / 3
        # before kill + TTL: the time after that deadline is what the protocol takes
        left_s = (float(r.zscore(keys.members(TOPIC, g0), "victim")) - server_ms(r)) / 1000
        change("kill", lambda: victim_process.kill(0), gone="victim")
        result["rebalance_s_kill_after_ttl"] = round(result["rebalance_s_kill"] - args.ttl_s, 3)
        result["rebalance_s_kill_after_deadline"] = round(result["rebalance_s_kill"] - left_s, 3)
        result["moves_per_change"] = changes
        result["rebalance_detail"] = where
        if args.trace:
            result["rebalance_trace"] = trace
    finally:
        fleet.close()
        victim_process.close()
        r.close()
    result["load_average_end"] = list(os.getloadavg())
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
    p.add_argument(
        "--owed-interval-ms",
        type=int,
        default=None,
        help="a member owed shards (LockClient.owed) rounds this often instead of every lock "
        "interval (default: a quarter lock interval, as the consumer does: "
        "eventbus.consumer.ownership.OWED_ROUNDS; 0: every lock interval, the consumer before s9)",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--coordination-slots",
        choices=["shared", "topic"],
        default="shared",
        help="the key layout (setting coordination_slots); one redis-server: same cost, other "
        "key names (on a Cluster, 'topic' puts each topic's coordination on its slot's node)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="add rebalance_trace: per change, each member's round that changed its share or "
        "locks and each release, in seconds from the change",
    )
    a = p.parse_args()
    if a.owed_interval_ms is None:  # the consumer's cadence (`OWED_ROUNDS` = 4 rounds an interval)
        a.owed_interval_ms = a.lock_interval_ms // 4
    with RedisServer() as server:
        res = measure(a, server.url)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
