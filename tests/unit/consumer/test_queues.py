"""Per-resource queues and their workers (`eventbus.consumer.queues`): no Redis; `process` is a
test double that records what it was given and when."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from eventbus.consumer.queues import ResourceQueues
from eventbus.consumer.shards import HeldShard, Item, read_items
from eventbus.consumer.watchdog import Slot, Watchdog
from eventbus.protocol.codec import F_RESOURCE

pytestmark = pytest.mark.anyio

HELD = HeldShard(shard=0, stream="s:0", token=1, generation=1)


def entries(*pairs: tuple[str, int]) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """Entries ``(entry ID, fields)`` for (resource, n) pairs; entry ID ``n-0``."""
    return [(f"{n}-0".encode(), {F_RESOURCE: rid.encode()}) for rid, n in pairs]


def items(held: HeldShard, *pairs: tuple[str, int]) -> list[Item]:
    return read_items(held, entries(*pairs), None)


def label(item: Item) -> str:
    return f"{item.fields[F_RESOURCE].decode()}{item.entry_id.decode().split('-')[0]}"


@asynccontextmanager
async def workers(
    queues: ResourceQueues, process: Callable[[Item], Awaitable[float | None]], n: int
) -> AsyncIterator[anyio.Event]:
    """`n` workers on `queues`, each with a watchdog slot, running each queue's head through
    `process` (the delay it returns, or None once the entry is finished); yields the `stopped`
    event; cancels them on exit."""
    stopped = anyio.Event()
    watchdog = Watchdog(None)

    async def run(queue: deque[Item], slot: Slot) -> float | None:
        while queue:
            delay = await process(queue[0])
            if delay is not None:
                return delay
            queue.popleft()
        return None

    async def worker() -> None:
        await queues.worker(run, watchdog.slot(), tg, stopped)

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(worker)
        yield stopped
        tg.cancel_scope.cancel()


def test_dispatch_counts_the_entries_started_and_read_items_skips_deleted_ones() -> None:
    started: list[tuple[HeldShard, int]] = []
    queues = ResourceQueues(lambda held, n: started.append((held, n)))
    items = read_items(HELD, [*entries(("a", 1)), (b"2-0", None), *entries(("b", 3))], None)
    assert [i.entry_id for i in items] == [b"1-0", b"3-0"]
    queues.dispatch(HELD, items)
    assert started == [(HELD, 2)]


async def test_each_resource_runs_in_entry_order_across_workers() -> None:
    done: list[str] = []
    finished = anyio.Event()

    async def process(item: Item) -> None:
        await anyio.lowlevel.checkpoint()  # let other workers interleave
        done.append(label(item))
        if len(done) == 12:
            finished.set()

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 3):
        queues.dispatch(HELD, items(HELD, *[(rid, n) for n in range(4) for rid in "abc"]))
        with anyio.fail_after(5):
            await finished.wait()
    for rid in "abc":
        assert [x for x in done if x[0] == rid] == [f"{rid}{n}" for n in range(4)]


async def test_one_worker_per_resource_and_different_resources_concurrently() -> None:
    """Three workers, one resource held by a blocked handler: its next entry waits, while the
    other resource runs at the same time."""
    running: dict[str, int] = {}
    overlap: list[str] = []
    both_running = anyio.Event()
    release, all_done = anyio.Event(), anyio.Event()
    done: list[str] = []

    async def process(item: Item) -> None:
        rid = item.fields[F_RESOURCE].decode()
        running[rid] = running.get(rid, 0) + 1
        if running[rid] > 1:
            overlap.append(rid)
        if sum(running.values()) == 2:
            both_running.set()
        await release.wait()
        running[rid] -= 1
        done.append(label(item))
        if len(done) == 3:
            all_done.set()

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 3):
        queues.dispatch(HELD, items(HELD, ("a", 1), ("a", 2), ("b", 3)))
        with anyio.fail_after(5):
            await both_running.wait()  # a1 and b3 at once
        for _ in range(20):  # give a third (free) worker every chance to start a2: it must not
            await anyio.lowlevel.checkpoint()
        assert running == {"a": 1, "b": 1}
        release.set()
        with anyio.fail_after(5):
            await all_done.wait()
    assert overlap == []
    assert done.index("a1") < done.index("a2")


async def test_same_resource_on_different_shards_are_different_queues() -> None:
    other = HeldShard(shard=1, stream="s:1", token=1, generation=2)
    both = anyio.Event()
    release = anyio.Event()
    active = 0

    async def process(item: Item) -> None:
        nonlocal active
        active += 1
        if active == 2:
            both.set()
        await release.wait()

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 2):
        queues.dispatch(HELD, items(HELD, ("a", 1)))
        queues.dispatch(other, items(other, ("a", 2)))
        with anyio.fail_after(5):
            await both.wait()
        release.set()


async def test_a_retry_does_not_hold_the_only_worker_and_comes_back_first_in_its_queue() -> None:
    """One worker: a1 asks to be retried after a delay; b runs meanwhile; then a1 again, then
    a2 (the retried entry stays at the head of its queue)."""
    calls: list[str] = []
    failures = {"a1": 1}
    finished = anyio.Event()

    async def process(item: Item) -> float | None:
        name = label(item)
        calls.append(name)
        if failures.get(name):
            failures[name] -= 1
            return 0.05
        if len(calls) == 4:
            finished.set()
        return None

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 1):
        queues.dispatch(HELD, items(HELD, ("a", 1), ("a", 2), ("b", 3)))
        with anyio.fail_after(5):
            await finished.wait()
    assert calls == ["a1", "b3", "a1", "a2"]


async def test_stopping_fires_waiting_retry_timers_at_once() -> None:
    calls: list[str] = []
    first, retried = anyio.Event(), anyio.Event()

    async def process(item: Item) -> float | None:
        calls.append(label(item))
        if len(calls) == 1:
            first.set()
            return math.inf  # would wait forever, but for `stopped`
        retried.set()
        return None

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 1) as stopped:
        queues.dispatch(HELD, items(HELD, ("a", 1)))
        with anyio.fail_after(5):
            await first.wait()
            stopped.set()
            await retried.wait()
    assert calls == ["a1", "a1"]


async def test_a_resource_emptied_and_refilled_is_scheduled_again() -> None:
    calls: list[str] = []
    changed = anyio.Event()

    async def process(item: Item) -> None:
        nonlocal changed
        calls.append(label(item))
        changed.set()
        changed = anyio.Event()

    queues = ResourceQueues(lambda h, n: None)
    async with workers(queues, process, 2):
        queues.dispatch(HELD, items(HELD, ("a", 1)))
        with anyio.fail_after(5):
            while calls != ["a1"]:
                await changed.wait()
            await anyio.lowlevel.checkpoint()  # the worker returns the emptied queue
            queues.dispatch(HELD, items(HELD, ("a", 2)))
            while calls != ["a1", "a2"]:
                await changed.wait()


@pytest.mark.parametrize(
    "dispatches",
    [
        pytest.param([(0, ("a", 1))], id="one-resource"),
        # a read round dispatches each shard's entries in turn, before any worker runs: the
        # resources of the first shard must not be counted again for the second
        pytest.param([(0, ("a", 1), ("b", 1)), (1, ("c", 1), ("d", 1))], id="two-shards"),
    ],
)
async def test_a_ready_resource_wakes_one_idle_worker_not_every_idle_worker(
    dispatches: list[tuple[Any, ...]],
) -> None:
    """16 idle workers, entries of N resources dispatched: N worker tasks are woken to run them
    (a shared event woke all 16, each a task step for nothing: most of a consumer's CPU at a
    trickle; waking one per resource in the ready queue woke 2 + 4 for two shards' 4)."""
    expected = sum(len(d) - 1 for d in dispatches)
    seen: list[Item] = []
    handled = anyio.Event()

    async def process(item: Item) -> None:
        seen.append(item)
        if len(seen) == expected:
            handled.set()

    queues = ResourceQueues(lambda h, n: None)
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    woken: list[object] = []  # the other tasks scheduled to resume (futures' wake-ups)
    call_soon = loop.call_soon

    def counting(callback: Callable[..., object], *args: object, **kw: Any) -> asyncio.Handle:
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task) and task is not me:
            woken.append(task)
        return call_soon(callback, *args, **kw)

    async with workers(queues, process, 16):
        for _ in range(3):  # every worker waits for work
            await anyio.lowlevel.checkpoint()
        loop.call_soon = counting  # type: ignore[method-assign]
        try:
            for shard, *pairs in dispatches:
                held = HeldShard(shard=shard, stream=f"s:{shard}", token=1, generation=1)
                queues.dispatch(held, items(held, *pairs))
            with anyio.fail_after(5):
                await handled.wait()
            for _ in range(3):  # whatever else was woken runs now
                await anyio.lowlevel.checkpoint()
        finally:
            del loop.call_soon
    assert len(woken) == expected


async def test_workers_start_on_demand_up_to_the_most_allowed() -> None:
    """No worker before a resource is ready; one more for each resource that becomes ready with
    none idle, never more than `most`; a resource past them waits for a busy one; an idle one
    takes the next resource rather than a new one starting."""
    stopped = anyio.Event()
    watchdog = Watchdog(None)
    release = anyio.Event()
    started: list[int] = []
    running: list[str] = []
    done: list[str] = []

    async def run(queue: deque[Item], slot: Slot) -> float | None:
        while queue:
            running.append(label(queue[0]))
            await release.wait()
            done.append(label(queue.popleft()))
        return None

    async with anyio.create_task_group() as tg:

        async def worker() -> None:
            await queues.worker(run, watchdog.slot(), tg, stopped)

        def spawn() -> None:
            started.append(len(started))
            tg.start_soon(worker)

        queues = ResourceQueues(lambda h, n: None)
        queues.start_workers(spawn, 2)
        await anyio.wait_all_tasks_blocked()
        assert started == []  # nothing to run yet

        queues.dispatch(HELD, items(HELD, ("a", 1), ("b", 2), ("c", 3)))
        await anyio.wait_all_tasks_blocked()
        assert len(started) == 2  # the most: c waits for one of them
        assert sorted(running) == ["a1", "b2"]

        release.set()
        with anyio.fail_after(5):
            while len(done) < 3:
                await anyio.wait_all_tasks_blocked()
        queues.dispatch(HELD, items(HELD, ("d", 4)))  # both idle now: one of them takes it
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()

    assert len(started) == 2
    assert sorted(done) == ["a1", "b2", "c3", "d4"]
