"""``eventbus topic migrate-slots``: a stopped topic's coordination moves between the shared and
the per-topic layout (`eventbus.cli.migrate_slots`), on a real redis-server and on a Redis
Cluster: it refuses while a member is live, carries fencing tokens as max(old, new), parked and
control entries and checkpoints, and the consumers started after it continue above every token
handed out before it; a member still on the old layout takes no shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from support import Recorder, Tick, running, wait_until
from typer.testing import CliRunner

from eventbus import Context, EventBus, Settings
from eventbus.cli import app
from eventbus.cli.migrate_slots import MOVED, LiveMembers, move, plan
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True),
]
RUNNER = CliRunner(env={"COLUMNS": "200"})
TOPIC, GROUP, SHARDS = "orders", "billing", 4
SHARED, PER_TOPIC = Keys(), Keys(slots="topic")


def _cli(url: str, *args: str) -> Any:
    """The command's result (run it in a thread: it runs its own event loop)."""
    return RUNNER.invoke(app, ["topic", "migrate-slots", TOPIC, *args, "--redis-url", url])


def _consumer(settings: Settings, rec: Recorder) -> EventBus:
    bus = EventBus(settings)

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    return bus


async def _tokens(r: Any, keys: Keys) -> dict[int, int]:
    raw = await r.hgetall(keys.locks(TOPIC, GROUP))
    return {int(k[:-6]): int(v) for k, v in raw.items() if k.endswith(b":token")}


async def _publish(settings: Settings, first: int, count: int) -> None:
    async with EventBus(settings) as pub:
        for seq in range(first, first + count):
            for rid in ("a", "b", "c"):
                await pub.publish(TOPIC, Tick(resource=rid, seq=seq), resource_id=rid)


async def test_the_move_refuses_while_a_member_of_either_layout_is_live(
    settings: Callable[..., Settings], redis_db: str, r: Any
) -> None:
    old = settings(shards=SHARDS, idle_release_ms=60_000)
    rec = Recorder()
    await _publish(old, 0, 1)
    async with running(_consumer(old, rec)):
        await rec.wait_for(3)
        p = await plan(r, SHARED, TOPIC, SHARDS, "topic")
        assert GROUP in {g for _, g in p.live}
        with pytest.raises(LiveMembers, match="live members"):
            await move(r, p)
        for args in (("--to", "topic"), ("--to", "topic", "--dry-run")):
            result = await anyio.to_thread.run_sync(_cli, redis_db, *args)
            assert result.exit_code == 1, result.output
            assert "live members" in result.output and GROUP in result.output
    # nothing was written to either layout
    assert await r.exists(PER_TOPIC.locks(TOPIC, GROUP), PER_TOPIC.members(TOPIC, GROUP)) == 0
    assert MOVED.encode() not in await r.zrange(SHARED.members(TOPIC, GROUP), 0, -1)

    # a live member of the target layout (started before the move) is refused too
    early = LockClient(
        Member(r, PER_TOPIC, old, TOPIC, "early", "early-1", EVENTBUS), shards=SHARDS
    )
    await early.acquire(range(SHARDS))
    with pytest.raises(LiveMembers, match="topic layout, group early: early-1"):
        await move(r, await plan(r, SHARED, TOPIC, SHARDS, "topic"))
    unknown = await anyio.to_thread.run_sync(
        RUNNER.invoke,
        app,
        ["topic", "migrate-slots", "nope", "--to", "topic", "--redis-url", redis_db],
    )
    assert unknown.exit_code == 1 and "unknown topic 'nope'" in unknown.output


async def test_a_moved_topic_continues_in_order_with_fencing_tokens_above_the_old_ones(
    settings: Callable[..., Settings], redis_db: str, r: Any
) -> None:
    old = settings(shards=SHARDS, liveness_ttl_s=1.0)
    new = settings(shards=SHARDS, liveness_ttl_s=1.0, coordination_slots="topic")
    rec = Recorder()
    await _publish(old, 0, 5)
    async with running(_consumer(old, rec)):
        await rec.wait_for(15)
    # history: tokens handed out before (raised on shard 0), an earlier run's token in the new
    # layout above the old one (shard 1), a parked resource, an operator request, checkpoints
    await r.hset(SHARED.locks(TOPIC, GROUP), "0:token", 41)
    await r.hset(PER_TOPIC.locks(TOPIC, GROUP), "1:token", 99)
    await r.hset(SHARED.parked(TOPIC, GROUP), "zzz", "1-0")
    await r.hset(SHARED.control(TOPIC, GROUP), "ab12", '{"kind": "requeue"}')
    await r.hset(SHARED.checkpoints(TOPIC), mapping={"0": "5-0", "0:count": "3", "1": "7-0"})
    await r.hset(PER_TOPIC.checkpoints(TOPIC), mapping={"1": "9-0", "1:count": "8"})
    before = await _tokens(r, SHARED)
    assert set(before) == set(range(SHARDS)) and before[0] == 41

    dry = await anyio.to_thread.run_sync(lambda: _cli(redis_db, "--to", "topic", "--dry-run"))
    assert dry.exit_code == 0, dry.output
    assert "would move" in dry.output and "highest 99" in dry.output
    assert await r.exists(PER_TOPIC.parked(TOPIC, GROUP)) == 0  # a dry run writes nothing

    done = await anyio.to_thread.run_sync(lambda: _cli(redis_db, "--to", "topic"))
    assert done.exit_code == 0, done.output
    moved = await _tokens(r, PER_TOPIC)
    assert moved == {s: max(before[s], 99 if s == 1 else 0) for s in range(SHARDS)}
    assert await r.hgetall(PER_TOPIC.parked(TOPIC, GROUP)) == {b"zzz": b"1-0"}
    assert await r.hget(PER_TOPIC.control(TOPIC, GROUP), "ab12") == b'{"kind": "requeue"}'
    assert await r.hgetall(PER_TOPIC.checkpoints(TOPIC)) == {
        b"0": b"5-0", b"0:count": b"3", b"1": b"9-0", b"1:count": b"8"  # the further one
    }  # fmt: skip
    assert await r.exists(SHARED.parked(TOPIC, GROUP), SHARED.checkpoints(TOPIC)) == 0
    assert await r.exists(PER_TOPIC.lock_epoch(TOPIC, GROUP)) == 0  # a new era

    # a member still on the old layout takes nothing: the moved mark holds every lock
    stale = LockClient(Member(r, SHARED, old, TOPIC, GROUP, "old-release", EVENTBUS), shards=SHARDS)
    assert (await stale.acquire(range(SHARDS))).grants == {}
    await stale.release([], leave=True)

    await _publish(new, 5, 5)
    async with running(bus := _consumer(new, rec)):
        await rec.wait_for(30)
        held = bus.consumers[0].ownership.table.held
        await wait_until(lambda: len(held) == SHARDS)
        assert all(held[s].token > moved[s] for s in range(SHARDS))
    assert rec.by_resource() == {rid: list(range(10)) for rid in ("a", "b", "c")}
    after = await _tokens(r, PER_TOPIC)
    assert all(after[s] > moved[s] >= before[s] for s in range(SHARDS))
    # the moved layout's own keys ended up on their topic's slot, apart from the registry's
    if hasattr(r, "get_node_from_key"):
        slot = await r.cluster_keyslot(PER_TOPIC.locks(TOPIC, GROUP))
        assert slot == await r.cluster_keyslot(PER_TOPIC.checkpoints(TOPIC))
        assert slot != await r.cluster_keyslot(PER_TOPIC.topics())

    # and back: the shared layout's mark is cleared, its tokens continue above both
    back = await anyio.to_thread.run_sync(lambda: _cli(redis_db, "--to", "shared"))
    assert back.exit_code == 0, back.output
    assert MOVED.encode() not in await r.zrange(SHARED.members(TOPIC, GROUP), 0, -1)
    assert MOVED.encode() in await r.zrange(PER_TOPIC.members(TOPIC, GROUP), 0, -1)
    assert await _tokens(r, SHARED) == after
    again = LockClient(
        Member(r, SHARED, old, TOPIC, GROUP, "after-move-back", EVENTBUS), shards=SHARDS
    )
    grants = (await again.acquire(range(SHARDS))).grants
    assert {s: g.token for s, g in grants.items()} == {s: after[s] + 1 for s in range(SHARDS)}
