"""Catch-up hands a batch subscriber batches, as the live consumer does: a group behind the
archive is caught up (standalone or by a live consumer's hook) with its batch handler called on
up to `max_batch` consecutive entries at once, every event once, in entry order; a failing
batch is retried, split, and only its bad event dead-lettered (the live `BatchRunner`'s rules).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_catchup_handling import (
    GROUP,
    MODES,
    TOPIC,
    Tick,
    archive_backlog,
    create_group,
    letters_of,
    publish,
    run_catch_up,
    settings_for,
)

from eventbus import Context, EventBus
from eventbus.tier import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def batch_bus(
    redis_db: str,
    calls: list[list[tuple[str, int]]],
    *,
    archive: Any = None,
    broken: frozenset[tuple[str, int]] = frozenset(),
    **sub: Any,
) -> EventBus:
    bus = EventBus(settings_for(redis_db), archive=archive)

    @bus.subscriber(TOPIC, group=GROUP, batch=True, **sub)
    async def handle(events: list[Tick], ctxs: list[Context]) -> None:
        seen = [(e.resource, e.seq) for e in events]
        if broken & set(seen):
            raise RuntimeError(f"cannot handle {sorted(broken & set(seen))}")
        calls.append(seen)

    return bus


@pytest.mark.parametrize("mode", MODES)
async def test_a_batch_subscriber_catches_up_in_batches_in_entry_order(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    store = open_store(str(tmp_path / "segments"))
    calls: list[list[tuple[str, int]]] = []
    bus = batch_bus(redis_db, calls, archive=store if mode == "live" else None, max_batch=40)
    async with bus:
        await create_group(bus)
        for s in range(0, 300, 50):  # resources interleaved in the stream
            for rid in ("a", "b", "c"):
                await publish(bus, rid, range(s, s + 50))
        await archive_backlog(bus, store)
        await run_catch_up(mode, bus, store, lambda: sum(map(len, calls)) >= 900)
    handled = [pair for batch in calls for pair in batch]
    expected = [(rid, n) for s in range(0, 300, 50) for rid in "abc" for n in range(s, s + 50)]
    assert handled == expected  # each once, in entry order
    assert max(map(len, calls)) == 40  # batches, not events one by one (segments of 300)


@pytest.mark.parametrize("mode", MODES)
async def test_a_failing_batch_in_catch_up_is_split_down_to_its_bad_event(
    redis_db: str, tmp_path: Any, mode: str
) -> None:
    store = open_store(str(tmp_path / "segments"))
    calls: list[list[tuple[str, int]]] = []
    bus = batch_bus(
        redis_db,
        calls,
        archive=store if mode == "live" else None,
        broken=frozenset({("a", 13)}),
        max_batch=20,
        max_attempts=2,
    )
    async with bus:
        await create_group(bus)
        ids = await publish(bus, "a", range(40))
        await archive_backlog(bus, store)

        async def settled() -> bool:
            return sum(map(len, calls)) + len(await letters_of(bus)) >= 40

        await run_catch_up(mode, bus, store, settled)
        letters = await letters_of(bus)
    handled = [n for batch in calls for _, n in batch]
    assert handled == [n for n in range(40) if n != 13]
    assert [(d.entry_id, d.reason) for d in letters] == [(ids[13], "failed")]
