"""`eventbus.consumer.running.run_consumers`: what it says and reports around its consumers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anyio
import pytest

from eventbus.consumer.running import MANY_CONSUMERS, run_consumers

pytestmark = pytest.mark.anyio


@dataclass
class _Settings:
    gc_threshold: int = 0


@dataclass
class _Quick:
    """A consumer that returns at once: what run_consumers does around consumers, alone."""

    settings: _Settings = field(default_factory=_Settings)
    started: anyio.Event = field(default_factory=anyio.Event)
    ran: bool = False

    async def run(self, stop: anyio.Event) -> None:
        self.ran = True
        self.started.set()


async def test_many_subscriptions_in_one_process_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """300 groups in one process idled at 85 % of a core with nothing said;
    past `MANY_CONSUMERS` subscriptions the run says what they cost and what to do instead."""
    many = [_Quick() for _ in range(MANY_CONSUMERS + 1)]
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        await run_consumers(many, anyio.Event(), handle_signals=False)  # type: ignore[arg-type]
    assert all(c.ran for c in many)
    [warning] = [r for r in caplog.records if "subscriptions" in r.getMessage()]
    assert f"runs {MANY_CONSUMERS + 1} subscriptions" in warning.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        await run_consumers(many[:MANY_CONSUMERS], anyio.Event(), handle_signals=False)  # type: ignore[arg-type]
    assert not [r for r in caplog.records if "subscriptions" in r.getMessage()]


async def test_started_is_reported_once_the_consumers_run() -> None:
    """`await tg.start(...)` returns from run_consumers (no broadcast consumer to wait for)."""
    quick = [_Quick(), _Quick()]
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: run_consumers(
                quick, anyio.Event(), handle_signals=False, task_status=task_status
            )
        )  # type: ignore[arg-type]
    assert all(c.ran for c in quick)
