"""Short versions of the chaos scenarios of ``stress/chaos.py``, and tests of its checker.

Each scenario runs the real harness as a subprocess (its own redis-server, publisher and consumer
processes, faults on a time schedule) on a few thousand events and asserts its JSON report: no
event lost, no per-resource order violation, no consumer crash or hang, and the scenario's own
facts (the fault was injected, another consumer took over, the poison event was dead-lettered).
The long versions are the same commands with their default sizes (see stress/chaos.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAOS = ROOT / "stress" / "chaos.py"
TTL = 2.0  # the harness's default liveness TTL in short runs


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"stress_{name}", ROOT / "stress" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


ledger = _load("ledger")


def chaos(tmp_path: Path, scenario: str, *args: str, plot: bool = False) -> dict[str, Any]:
    """Run one scenario; return its report. The exit code must agree with the report."""
    out, png = tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.png"
    proc = subprocess.run(  # one publisher process: fewer interpreters to start on a small CI
        [
            sys.executable,
            str(CHAOS),
            scenario,
            "--publishers",
            "1",
            *args,
            "--json",
            str(out),
            *(["--plot", str(png)] if plot else ["--no-plot"]),
            "--workdir",
            str(tmp_path / "ledgers"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), f"no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res: dict[str, Any] = json.loads(out.read_text())
    assert proc.returncode == (0 if res["ok"] else 1), proc.stderr[-3000:]
    if plot:
        assert png.stat().st_size > 10_000
    return res


def assert_sound(res: dict[str, Any]) -> None:
    """What every scenario must show: nothing lost, order kept, no crash, all acked."""
    assert res["events"] > 0
    assert res["lost"] == 0, res["lost_examples"]
    assert res["order_violations"] == 0, res["violation_examples"]
    assert res["incidents"] == [], [
        {k: v for k, v in i.items() if k != "output_tail"} | {"tail": i.get("output_tail")}
        for i in res["incidents"]
    ]
    assert res["drain"]["drained"], res["drain"]
    assert res["unexpected_dead_letter_count"] == 0, res["unexpected_dead_letters"]
    assert res["handled"] + res["dead_lettered"] >= res["events"]
    assert res["ok"], res["checks"]


def consumer_faults(res: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    faults = [f for f in res["faults"] if f["kind"] == kind]
    assert faults, f"no {kind} fault was injected"
    return faults


def assert_no_stale_start_but_at_a_sigcont(res: dict[str, Any]) -> None:
    """No handler started with a superseded fencing token, but the documented limit: a process
    stopped between the library's fence check and the handler's first line runs that handler at
    its SIGCONT (docs/semantics.md, limit 2), told apart by the checker (the fence no longer held
    at the handler's first line; one per pause at most). The examples carry both consumers'
    lock and lease timelines."""
    assert res["stale_token_starts"] == res["stale_token_starts_at_sigcont"], res[
        "stale_token_examples"
    ]


# -- the checker itself -------------------------------------------------------------------------
def _handling(seq: int, end: int, entry: str, consumer: int = 0, ok: bool = True) -> Any:
    return ledger.Handling(consumer, ok, "r", seq, entry, 1, 0, 1, end - 5, end, 0, "e")


def test_checker_finds_loss_reordering_and_duplicates() -> None:
    led = ledger.Ledgers()
    led.published = [ledger.Published("r", s, f"{s}-0", s, "-") for s in range(1, 7)]
    led.handlings = [
        _handling(1, 10, "1-0"),
        _handling(3, 20, "3-0"),
        _handling(2, 30, "2-0"),  # after 3: a violation
        _handling(3, 40, "3-0", consumer=1),  # re-delivery of 3: a duplicate, not a violation
        _handling(5, 50, "5-9"),  # stored twice by a publisher retry: counted as republished
        _handling(5, 60, "5-0"),
        _handling(6, 70, "6-0", ok=False),  # raised and never dead-lettered: lost
    ]
    res = ledger.check(led, [], [], t0_ns=0)
    assert res["lost"] == 2  # 4 never handled, 6 only raised
    assert [e["seq"] for e in res["lost_examples"]] == [4, 6]
    assert res["order_violations"] == 1
    assert res["violation_examples"][0]["seq"] == 2
    assert (res["duplicates_redelivered"], res["duplicates_republished"]) == (1, 1)

    dead = [ledger.DeadLetter("r", 6, "6-0", 4, "PoisonEvent")]
    assert ledger.check(led, dead, [], t0_ns=0)["lost"] == 1


def test_checker_measures_takeover_from_the_fault_to_another_consumer() -> None:
    led = ledger.Ledgers()
    led.published = [ledger.Published("r", s, f"{s}-0", s, "-") for s in range(1, 4)]
    led.handlings = [
        _handling(1, 1_000, "1-0", consumer=0),
        _handling(2, 3_000, "2-0", consumer=0),  # the victim itself: not a takeover
        _handling(3, 2_500_000_000, "3-0", consumer=1),
    ]
    faults = [{"kind": "kill", "t_ns": 2_000, "victim": 0, "victim_shards": [0]}]
    ledger.check(led, [], faults, t0_ns=0)
    assert faults[0]["takeover_s"] == pytest.approx(2.5, abs=1e-3)


def test_checker_counts_handlers_started_with_a_superseded_token() -> None:
    new_owner = ledger.Handling(1, True, "r", 1, "1-0", 2, 0, 1, 90, 100, 0, "e")
    old_owner = ledger.Handling(0, True, "r", 2, "2-0", 1, 0, 1, 200, 210, 0, "e")
    before = ledger.Handling(0, True, "r", 0, "0-0", 1, 0, 1, 10, 20, 0, "e")
    count, examples = ledger.stale_token_starts([before, new_owner, old_owner])
    assert count == 1
    assert examples[0]["run"]["seq"] == 2 and examples[0]["after"]["token"] == 2


def test_checker_tells_stale_starts_at_a_sigcont_apart() -> None:
    led = ledger.Ledgers()
    led.published = [ledger.Published("r", s, f"{s}-0", s, "-") for s in (1, 2)]
    led.handlings = [
        ledger.Handling(1, True, "r", 1, "1-0", 2, 0, 1, 90, 100, 0, "e"),  # the new owner
        ledger.Handling(0, True, "r", 2, "2-0", 1, 0, 1, 5_000, 5_010, 0, "e"),  # woken, stale
    ]
    pause = {"kind": "pause", "victim": 0, "victim_shards": [0], "t_ns": 50, "end_ns": 4_990}
    res = ledger.check(led, [], [pause], t0_ns=0)
    assert (res["stale_token_starts"], res["stale_token_starts_at_sigcont"]) == (1, 1)
    other = {**pause, "victim": 2}  # not the stopped process: unexplained
    res = ledger.check(led, [], [other], t0_ns=0)
    assert (res["stale_token_starts"], res["stale_token_starts_at_sigcont"]) == (1, 0)


def test_checker_counts_a_stale_start_whose_fence_still_held_even_at_a_sigcont() -> None:
    """Only a start at which the fence no longer held (the lease ran out while the process was
    stopped after the library's check) is the documented limit; one at which the library still
    believed it held the shard under a valid lease is a gap in the fence (FINDINGS 10). And a
    stopped process is in that window for one handler call at most."""
    led = ledger.Ledgers()
    led.published = [ledger.Published("r", s, f"{s}-0", s, "-") for s in (1, 2, 3)]
    new_owner = ledger.Handling(1, True, "r", 1, "1-0", 2, 0, 1, 90, 100, 0, "e")
    pause = {"kind": "pause", "victim": 0, "victim_shards": [0], "t_ns": 50, "end_ns": 4_990}

    def woken(*fenced: bool | None) -> tuple[int, int]:
        led.handlings = [new_owner] + [
            ledger.Handling(0, True, "r", 2 + i, f"{2 + i}-0", 1, 0, 1, 5_000 + i, 5_010, 0, "e", f)
            for i, f in enumerate(fenced)
        ]
        res = ledger.check(led, [], [pause], t0_ns=0)
        return res["stale_token_starts"], res["stale_token_starts_at_sigcont"]

    assert woken(False) == (1, 1)  # the lease had run out at its first line: the limit
    assert woken(None) == (1, 1)  # a ledger without the flag: by the time alone
    assert woken(True) == (1, 0)  # still fenced at its first line: a gap
    assert woken(False, False) == (2, 1)  # a second one after the SIGCONT is unexplained


def test_ledger_lines_with_and_without_the_fence_flag(tmp_path: Path) -> None:
    path = tmp_path / "con-0.log"
    w = ledger.LineWriter(path)
    for flag in ("1", "0", "-"):
        w.write(ledger.HANDLED, "r", 1, "1-0", 7, 2, 1, 10, 20, 0, "ab", flag)
    w.write(ledger.HANDLED, "r", 1, "1-0", 7, 2, 1, 10, 20, 0, "ab")  # an older harness's line
    w.close()
    led = ledger.Ledgers()
    ledger.read_consumer(path, 0, led)
    assert [h.fenced for h in led.handlings] == [True, False, None, None]
    assert led.torn_lines == 0


def test_torn_last_line_of_a_killed_consumer_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "con-3.log"
    w = ledger.LineWriter(path)
    w.write(ledger.HELLO, "c-1", 1)
    w.write(ledger.HANDLED, "r", 1, "1-0", 7, 2, 1, 10, 20, 0, "ab")
    w.close()
    with path.open("a") as f:
        f.write("H\tr\t2\t2-0\t7")  # SIGKILL in the middle of a line
    led = ledger.Ledgers()
    ledger.read_consumer(path, 3, led)
    assert [(h.consumer, h.seq, h.token) for h in led.handlings] == [(3, 1, 7)]
    assert led.consumer_ids == {3: "c-1"}
    assert led.torn_lines == 1


# -- the scenarios, short -----------------------------------------------------------------------
def test_steady(tmp_path: Path) -> None:
    res = chaos(tmp_path, "steady", "--events", "10000", "--rate", "4000", plot=True)
    assert_sound(res)
    assert res["events"] == 10_000 and res["publish_failed"] == 0
    assert res["handled"] == 10_000 and res["duplicates"] == 0
    assert res["latency_ms_p50"] is not None and res["events_per_s"] > 0


def test_kill_consumers(tmp_path: Path) -> None:
    res = chaos(
        tmp_path, "kill", "--events", "8000", "--rate", "2000", "--faults", "2", "--consumers", "3"
    )
    assert_sound(res)
    for f in consumer_faults(res, "kill"):
        # the dead consumer's shards were taken over once its liveness expired, not never
        if f.get("traffic_after"):
            assert f["takeover_s"] is not None and f["takeover_s"] < 3 * TTL + 3, f
    assert res["consumer_processes"] >= 3 + 2  # replacements were started


def test_pause_past_liveness_ttl(tmp_path: Path) -> None:
    res = chaos(
        tmp_path, "pause", "--events", "8000", "--rate", "2000", "--faults", "1", "--consumers", "3"
    )
    assert_sound(res)
    (f,) = consumer_faults(res, "pause")
    assert f["end_ns"] - f["t_ns"] > TTL * 1e9  # stopped past its TTL, then woken
    # shards are taken from a stopped consumer only after its liveness expired
    assert f["takeover_s"] is not None and 0.5 * TTL < f["takeover_s"] < 3 * TTL + 3, f


def test_sigterm_hands_over_without_waiting_for_the_ttl(tmp_path: Path) -> None:
    res = chaos(
        tmp_path, "term", "--events", "8000", "--rate", "2000", "--faults", "2", "--consumers", "3"
    )
    assert_sound(res)
    faults = consumer_faults(res, "term")
    assert all(f.get("end_ns") for f in faults), "a consumer did not exit after SIGTERM"
    measured = [f for f in faults if f.get("traffic_after")]
    assert measured, faults
    for f in measured:
        assert f["takeover_s"] is not None and f["takeover_s"] < TTL, f


def test_redis_restart_with_aof(tmp_path: Path) -> None:
    res = chaos(tmp_path, "redis-restart", "--events", "8000", "--rate", "2000", "--faults", "2")
    assert_sound(res)
    faults = consumer_faults(res, "redis-restart")
    assert {f["detail"] for f in faults} == {"SIGTERM", "SIGKILL"}
    last = max(f["end_ns"] for f in faults)
    assert res["plan"]["aof"]
    # Consumers came back after the last restart: the publisher went on after it (the plan
    # injects it at 90 % published), and the last event was handled after it. (The timeline's
    # one-second bins cannot tell: the bin holding the restart's end starts before it.)
    last_s = (last - res["t0_ns"]) / 1e9
    assert res["published_s"] > last_s, (res["published_s"], last_s)
    assert res["handling_s"] > last_s, (res["handling_s"], last_s)


def test_client_kill(tmp_path: Path) -> None:
    res = chaos(tmp_path, "client-kill", "--events", "8000", "--rate", "2000", "--faults", "3")
    assert_sound(res)
    faults = consumer_faults(res, "client-kill")
    assert len(faults) == 3 and all(f["killed"] >= 1 for f in faults), faults


def test_client_pause(tmp_path: Path) -> None:
    res = chaos(tmp_path, "client-pause", "--events", "8000", "--rate", "2000", "--faults", "2")
    assert_sound(res)
    faults = consumer_faults(res, "client-pause")
    # one pause shorter and one longer than the liveness TTL
    assert sorted(f["detail"] for f in faults) == ["CLIENT PAUSE 1000 ms", "CLIENT PAUSE 3000 ms"]


def test_net_delay(tmp_path: Path) -> None:
    res = chaos(
        tmp_path,
        "net-delay",
        "--events",
        "8000",
        "--rate",
        "2000",
        "--faults",
        "2",
        "--consumers",
        "3",
    )
    assert_sound(res)
    assert res["stale_token_starts"] == 0, res["stale_token_examples"]
    spiked, plain = consumer_faults(res, "net-delay")
    assert spiked["spike_s"] > TTL and "spike_s" not in plain
    # its requests were late past its TTL: its liveness expired and another consumer took over
    if spiked.get("traffic_after"):
        assert spiked["takeover_s"] is not None and spiked["takeover_s"] < 3 * TTL + 3, spiked


def test_partition(tmp_path: Path) -> None:
    res = chaos(
        tmp_path,
        "partition",
        "--events",
        "8000",
        "--rate",
        "2000",
        "--faults",
        "3",
        "--consumers",
        "3",
    )
    assert_sound(res)
    assert res["stale_token_starts"] == 0, res["stale_token_examples"]
    consumer, long, short = consumer_faults(res, "partition")
    assert consumer["blackhole_s"] > TTL and consumer["takeover_s"] is not None, consumer
    assert consumer["takeover_s"] > 0.5 * TTL  # not before the cut-off consumer's liveness ended
    timeout = res["plan"]["publish_timeout_s"]
    assert short["blackhole_s"] < timeout < long["blackhole_s"]
    assert short["publish_failed"] == 0 and long["publish_failed"] > 0, res["faults"]
    assert res["publish_failed"] == long["publish_failed"]  # failed, recorded, not lost


def test_poison_events_are_dead_lettered_while_others_go_on(tmp_path: Path) -> None:
    res = chaos(tmp_path, "poison", "--events", "6000", "--rate", "2000", "--poison", "3")
    assert_sound(res)
    assert res["poison_events"] == 3 and res["dead_lettered"] == 3
    assert res["poison_not_dead_lettered"] == []
    assert res["dead_letter_attempts"] == [res["plan"]["max_attempts"]]
    assert all(n >= res["plan"]["max_attempts"] for n in res["poison_attempts_recorded"].values())
    assert res["min_others_handled_during_retries"] > 0  # other resources were not held up
    assert res["poison_overtaken_by_later_seq"] == 0  # its own later events waited


def test_slow_handler_with_backpressure(tmp_path: Path) -> None:
    res = chaos(tmp_path, "slow", "--events", "6000")
    assert_sound(res)
    assert res["max_concurrent_handlers"] <= res["plan"]["concurrency"]
    # publishing outran handling: the backlog waited in the streams, not in the consumers
    assert res["events_per_s"] < res["publish_per_s"]
    assert res["max_backlog"] > 0.2 * res["events"]


def assert_failovers(res: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """`count` planned failovers, each promoting another node, and no unplanned one."""
    faults = [f for f in res["faults"] if f["kind"] in ("failover", "cluster-failover")]
    assert len(faults) == count, res["faults"]
    for f in faults:
        assert f.get("error") is None, f
        assert f["new_primary"] != f["old_primary"] and f["promoted_s"] > 0, f
    assert len(res["promotions_logged"]) == count, res["promotions_logged"]
    return faults


def test_failover_of_the_sentinel_primary(tmp_path: Path) -> None:
    """The primary SIGKILLed twice under load on a Sentinel deployment, publishes waiting for a
    replica (``publish_replicas=1``): nothing acknowledged is lost, order holds, no handler
    starts with a superseded token; the killed node comes back as a replica each time."""
    res = chaos(tmp_path, "failover", "--events", "12000", "--rate", "2000", "--faults", "2")
    assert_sound(res)
    assert res["topology"]["kind"] == "sentinel" and res["plan"]["publish_replicas"] == 1
    assert res["stale_token_starts"] == 0, res["stale_token_examples"]
    first, second = assert_failovers(res, 2)
    assert second["old_primary"] == first["new_primary"]  # the promoted one was killed next
    assert all(f["rejoined_s"] >= f["promoted_s"] for f in (first, second))


def test_all_faults_mixed(tmp_path: Path) -> None:
    """One fault of every kind of `stress all`, failover included (so on a Sentinel deployment,
    the Redis-side faults on its current primary, publishes waiting for a replica)."""
    res = chaos(
        tmp_path, "all", "--events", "10000", "--rate", "2000", "--faults", "8", "--poison", "2",
        "--ttl", "2", plot=True,
    )  # fmt: skip
    assert_sound(res)
    assert len(res["faults"]) >= 8
    assert {f["kind"] for f in res["faults"]} == set(res["plan"]["kinds"])  # one of each kind
    assert {"net-delay", "partition", "failover"} <= set(res["plan"]["kinds"])
    assert res["topology"]["kind"] == "sentinel" and res["plan"]["publish_replicas"] == 1
    assert_no_stale_start_but_at_a_sigcont(res)
    assert_failovers(res, 1)
    assert res["dead_lettered"] == 2


# -- on a Redis Cluster --------------------------------------------------------
def test_cluster_faults_mixed(tmp_path: Path) -> None:
    """The fault kinds of `stress all` on a 3-primary Redis Cluster: Redis-side faults on the
    node of the coordination hashtag (or another primary), network faults through one link per
    node and client process (MOVED and CLUSTER SLOTS rewritten to the client's own links)."""
    res = chaos(
        tmp_path, "all", "--cluster", "--events", "10000", "--rate", "2000", "--faults", "7",
        "--poison", "2", "--ttl", "2",
    )  # fmt: skip
    assert_sound(res)
    assert res["topology"]["kind"] == "cluster" and res["plan"]["publish_replicas"] == 0
    kinds = {"kill", "pause", "redis-restart", "client-kill", "client-pause", "net-delay",
             "partition"}  # fmt: skip
    assert {f["kind"] for f in res["faults"]} == kinds == set(res["plan"]["kinds"])
    assert_no_stale_start_but_at_a_sigcont(res)
    assert res["dead_lettered"] == 2
    (kill,) = consumer_faults(res, "client-kill")
    assert kill["killed"] >= 3  # every primary's clients


def test_cluster_failover_of_primaries_incl_the_hashtags(tmp_path: Path) -> None:
    """A Cluster with one replica per primary: the primary of the coordination hashtag, then
    another primary SIGKILLed under load; their replicas take over, the killed nodes come back
    as replicas. With ``publish_replicas=1`` nothing acknowledged is lost; order holds; no
    handler starts with a superseded token."""
    res = chaos(tmp_path, "cluster-failover", "--events", "12000", "--rate", "2000", "--faults",
                "2")  # fmt: skip
    assert_sound(res)
    assert res["topology"]["kind"] == "cluster" and len(res["topology"]["nodes"]) == 6
    assert res["plan"]["publish_replicas"] == 1
    assert res["stale_token_starts"] == 0, res["stale_token_examples"]
    first, second = assert_failovers(res, 2)
    assert first["hashtag_node"] and not second["hashtag_node"]
