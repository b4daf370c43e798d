"""A mixed fleet on redis-server: two eventbus consumers of the Verse profile and a Verse
consumer (`cases.verse_peer.VersePeer`, Verse's consumer loop re-implemented faithfully) in one
consumer group, events from eventbus's publisher of the profile and from Verse's
(`cases.verse_peer.publish_resource_event`). docs/verse.md states what this shows.

The run goes through four phases, so that each side's part is known: Verse's consumer alone
(it reads what both publishers wrote), then both sides sharing the shards, then eventbus's
consumers alone (they read what Verse's publisher wrote), then Verse's again after ours left
gracefully. Across all of it every event is handled exactly once, and each resource's events
in the order they were published.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from cases.verse_peer import VerseMessage, VersePeer, publish_resource_event
from cases.verse_profile_cases import CHANNEL, GROUP, TOPIC, Placed
from support import running, total_pending, wait_until

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio

RESOURCES = [f"order-{i}" for i in range(12)]


class Fleet:
    """The run's log: (side, order_id, seq) in the order handlers finished, one process."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.log: list[tuple[str, str, int]] = []
        self.published: list[tuple[str, int]] = []
        self._seq: Counter[str] = Counter()

    def record_verse(self, m: VerseMessage) -> None:
        if m.headers.get("event") == "placed":
            self.log.append(("verse", m.content["order_id"], m.content["seq"]))

    def peer(self, service_id: str) -> VersePeer:
        return VersePeer(self.redis, GROUP, service_id, [CHANNEL], handle=self.record_verse)

    async def publish(self, bus: EventBus, per_resource: int) -> set[tuple[str, int]]:
        """`per_resource` events of every resource, alternately from eventbus's publisher and
        Verse's; returns their (order_id, seq)."""
        batch = set()
        for n in range(per_resource):
            for rid in RESOURCES:
                seq = self._seq[rid]
                self._seq[rid] += 1
                if (n + seq) % 2:
                    await bus.publish(TOPIC, Placed(order_id=rid, seq=seq), resource_id=rid)
                else:
                    payload = {"order_id": rid, "seq": seq}
                    assert await publish_resource_event(self.redis, TOPIC, rid, "placed", payload)
                batch.add((rid, seq))
        self.published += sorted(batch)
        return batch

    def handled(self, batch: set[tuple[str, int]]) -> Callable[[], bool]:
        return lambda: batch <= {(rid, seq) for _, rid, seq in self.log}

    def sides(self, batch: set[tuple[str, int]]) -> set[str]:
        return {side for side, rid, seq in self.log if (rid, seq) in batch}


async def test_our_consumers_and_a_verse_consumer_share_one_group(
    r: Any, settings: Callable[..., Settings]
) -> None:
    fleet = Fleet(r)
    await fleet.peer("rb-0").init_groups()  # Verse's publishers write only where groups exist
    publisher = EventBus(settings(shards=16), profile="verse")
    ours = [EventBus(settings(shards=16), profile="verse") for _ in range(2)]
    for bus in ours:

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Placed, ctx: Context) -> None:
            await anyio.lowlevel.checkpoint()
            fleet.log.append(("ours", event.order_id, event.seq))

    async with anyio.create_task_group() as tg:
        # 1. Verse's consumer alone reads what both publishers wrote
        first = fleet.peer("rb-1")
        first_done = anyio.Event()
        tg.start_soon(_run_then_set, first, first_done)
        alone = await fleet.publish(publisher, 2)
        await wait_until(fleet.handled(alone))
        assert fleet.sides(alone) == {"verse"}

        async with running(*ours):
            # 2. both sides share the group's shards (how they split them depends on timing:
            # Verse re-locks at once after each iteration, ours keep the shards they are busy on)
            shared = await fleet.publish(publisher, 10)
            await wait_until(fleet.handled(shared))

            # 3. Verse's consumer stops (it unlocks at the end of its iteration): ours alone
            first.stopped.set()
            await first_done.wait()
            ours_alone = await fleet.publish(publisher, 2)
            await wait_until(fleet.handled(ours_alone))
            assert fleet.sides(ours_alone) == {"ours"}
            await wait_until(lambda: _no_pending(ours[0], r))

        # 4. ours left gracefully (locks released, liveness deleted): Verse's takes over
        second = fleet.peer("rb-2")
        tg.start_soon(second.run)
        again = await fleet.publish(publisher, 2)
        await wait_until(fleet.handled(again))
        assert fleet.sides(again) == {"verse"}
        second.stopped.set()
    await publisher.aclose()

    handled = Counter((rid, seq) for _, rid, seq in fleet.log)
    assert [k for k, n in handled.items() if n > 1] == []  # no double handling
    assert sorted(handled) == sorted(fleet.published)  # nothing lost
    order: dict[str, list[int]] = defaultdict(list)
    for _, rid, seq in fleet.log:
        order[rid].append(seq)
    assert all(seqs == sorted(seqs) for seqs in order.values())  # each resource in order
    assert {side for side, _, _ in fleet.log} == {"ours", "verse"}


async def _run_then_set(peer: VersePeer, done: anyio.Event) -> None:
    await peer.run()
    done.set()


async def _no_pending(bus: EventBus, r: Any) -> bool:
    return await total_pending(bus, TOPIC, GROUP, r) == 0
