"""`eventbus.ops.log_context`: what `HandlerLogFilter` puts on a record outside a handler,
during one, and during a batch (the end-to-end cases: `cases.handler_scope_cases`)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from eventbus import Context
from eventbus.ops.log_context import FIELDS, HandlerLogFilter, log_context

pytestmark = pytest.mark.anyio


def _ctx(entry_id: str, resource_id: str, event_type: str = "Placed") -> Context:
    return Context(
        "orders", "billing", 0, entry_id, resource_id, b"\1" * 16, event_type, 0, {}, 1, 1, "c"
    )


def _record(**extra: Any) -> Any:
    record = logging.makeLogRecord({"msg": "m", **extra})
    assert HandlerLogFilter().filter(record)
    return record


async def test_outside_a_handler_every_field_is_a_dash() -> None:
    record = _record()
    assert [getattr(record, f) for f in FIELDS] == ["-"] * len(FIELDS)


async def test_one_entry_and_an_extra_that_is_kept() -> None:
    async with log_context(None, _ctx("5-0", "r1")):
        record = _record(resource_id="given by the caller")
    assert (record.topic, record.group, record.entry_id, record.event_type) == (
        "orders",
        "billing",
        "5-0",
        "Placed",
    )
    assert record.resource_id == "given by the caller"
    assert _record().topic == "-"  # left again


async def test_a_batch_is_named_by_its_range_and_resources() -> None:
    batch = [_ctx("1-0", "a"), _ctx("2-0", "b", "Billed"), _ctx("3-0", "a")]
    async with log_context(None, batch):
        record = _record()
    assert (record.entry_id, record.resource_id, record.event_type) == (
        "1-0..3-0",
        "2 resources",
        "Billed,Placed",
    )
    async with log_context(None, batch[:1]):
        assert (_record().entry_id, _record().resource_id) == ("1-0", "a")


async def test_a_filter_for_json_adds_nothing_outside_a_handler() -> None:
    record = logging.makeLogRecord({"msg": "m"})
    assert HandlerLogFilter(outside=None).filter(record)
    assert not any(hasattr(record, f) for f in FIELDS)


async def test_eventbus_run_json_logs_carry_the_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """``--log-format json``: a record logged during a handler has the entry's fields."""
    import json

    from eventbus.ops.logs import configure

    configure(level="info", fmt="json", tty=False)
    try:
        async with log_context(None, _ctx("7-0", "r9")):
            logging.getLogger("shop").info("inside")
        logging.getLogger("shop").info("outside")
    finally:
        logging.basicConfig(force=True, handlers=[logging.NullHandler()])
    inside, outside = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert (inside["entry_id"], inside["resource_id"], inside["topic"]) == ("7-0", "r9", "orders")
    assert "entry_id" not in outside
