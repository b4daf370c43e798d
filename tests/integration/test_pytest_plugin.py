"""The pytest plugin (`eventbus.testing.pytest_plugin`, entry point ``pytest11``), tested as
users run it: pytester writes a conftest and tests, and runs pytest on them in a subprocess."""

from __future__ import annotations

import pytest

CONFTEST = """
import pytest
from pydantic import BaseModel
from eventbus import Context, EventBus, Settings


class OrderPlaced(BaseModel):
    order_id: str
    total_cents: int


class Invoiced(BaseModel):
    order_id: str


bus = EventBus(Settings(shards=2, retry_base_s=0.001, retry_max_s=0.002, max_attempts=2))
billed = []


@bus.subscriber("orders", group="billing")
async def bill(event: OrderPlaced, ctx: Context) -> None:
    if event.total_cents < 0:
        raise ValueError(f"negative total for {event.order_id}")
    billed.append(event.order_id)
    await bus.publish("invoices", Invoiced(order_id=event.order_id), resource_id=event.order_id)


@pytest.fixture
def eventbus_app():
    return bus
"""

TESTS = """
import anyio
import pytest
from conftest import Invoiced, OrderPlaced
from eventbus.testing import HandlerFailed

pytestmark = pytest.mark.anyio


async def test_handled_and_published(running_bus):
    await running_bus.publish("orders", OrderPlaced(order_id="o1", total_cents=5), resource_id="o1")
    await running_bus.drain()
    assert running_bus.events("orders") == [OrderPlaced(order_id="o1", total_cents=5)]
    assert [h.name for h in running_bus.handled] == ["bill"]
    [invoice] = await running_bus.published("invoices")
    assert invoice.as_(Invoiced) == Invoiced(order_id="o1") and invoice.resource_id == "o1"


async def test_fail_fast_reraises_from_drain(running_bus):
    o2 = OrderPlaced(order_id="o2", total_cents=-1)
    await running_bus.publish("orders", o2, resource_id="o2")
    with pytest.raises(HandlerFailed) as caught:
        await running_bus.drain()
    assert isinstance(caught.value.__cause__, ValueError)
    assert await running_bus.dead_letters("orders", "billing") == []
    assert len(running_bus.handled) == 1  # not retried


@pytest.mark.eventbus(fail_fast=False)
async def test_the_policy_on_request(running_bus):
    o3 = OrderPlaced(order_id="o3", total_cents=-1)
    await running_bus.publish("orders", o3, resource_id="o3")
    await running_bus.drain()
    [letter] = await running_bus.dead_letters("orders", "billing")
    assert letter.attempts == 2 and "negative total for o3" in letter.traceback
    assert [h.error is not None for h in running_bus.handled] == [True, True]


async def test_an_unnoticed_failure_fails_the_test(running_bus):
    o4 = OrderPlaced(order_id="o4", total_cents=-1)
    await running_bus.publish("orders", o4, resource_id="o4")
    while not running_bus.handled:  # no drain(): the failure is raised at teardown
        await anyio.sleep(0.005)
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_billing=TESTS)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_in_memory_with_fail_fast_by_default(pytester: pytest.Pytester) -> None:
    result = _run(pytester)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*test_an_unnoticed_failure_fails_the_test*", "*HandlerFailed*"])


def test_the_same_tests_on_a_real_redis(pytester: pytest.Pytester, redis_db: str) -> None:
    import redis

    result = _run(pytester, f"--eventbus-redis={redis_db}")
    result.assert_outcomes(passed=4, errors=1)
    with redis.Redis.from_url(redis_db) as client:
        assert client.keys("eventbus-test-*") == []  # each test's keys deleted after it


def test_the_env_var_selects_redis_too(
    pytester: pytest.Pytester, redis_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVENTBUS_TEST_REDIS_URL", redis_db)
    result = _run(pytester, "-k", "handled_and_published")
    result.assert_outcomes(passed=1)


def test_without_an_eventbus_app_fixture_it_says_what_to_define(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        "import pytest\npytestmark = pytest.mark.anyio\nasync def test_x(running_bus):\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*define a fixture `eventbus_app`*"])


APP_CONFTEST = (
    CONFTEST
    + """
from fastapi import FastAPI
from eventbus.fastapi import BusDep, lifespan

app = FastAPI(lifespan=lifespan(bus))


@app.post("/orders", status_code=202)
async def place(order: OrderPlaced, bus: BusDep) -> dict:
    return {"entry_id": await bus.publish("orders", order, resource_id=order.order_id)}


@pytest.fixture
def eventbus_asgi_app():
    return app
"""
)

APP_TESTS = """
import threading
import pytest
from fastapi.testclient import TestClient
from conftest import Invoiced, OrderPlaced, app
from eventbus.testing import HandlerFailed


def test_route_handler_assertion(running_app_bus):
    with TestClient(app) as client:
        assert client.post("/orders", json={"order_id": "a1", "total_cents": 5}).status_code == 202
        running_app_bus.drain()
        assert running_app_bus.events("orders") == [OrderPlaced(order_id="a1", total_cents=5)]
        [invoice] = running_app_bus.published("invoices")
        assert invoice.as_(Invoiced) == Invoiced(order_id="a1")
        assert threading.current_thread() is threading.main_thread()


def test_fail_fast_reraises_from_drain(running_app_bus):
    with TestClient(app) as client:
        client.post("/orders", json={"order_id": "a2", "total_cents": -1})
        with pytest.raises(HandlerFailed):
            running_app_bus.drain()


@pytest.mark.eventbus(fail_fast=False)
def test_the_policy_on_request(running_app_bus):
    with TestClient(app) as client:
        client.post("/orders", json={"order_id": "a3", "total_cents": -1})
        running_app_bus.drain()
        [letter] = running_app_bus.dead_letters("orders", "billing")
        assert letter.attempts == 2
"""


def _run_app(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(APP_CONFTEST)
    pytester.makepyfile(test_app=APP_TESTS)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_running_app_bus_in_memory(pytester: pytest.Pytester) -> None:
    _run_app(pytester).assert_outcomes(passed=3)


def test_running_app_bus_on_a_real_redis(pytester: pytest.Pytester, redis_db: str) -> None:
    import redis

    _run_app(pytester, f"--eventbus-redis={redis_db}").assert_outcomes(passed=3)
    with redis.Redis.from_url(redis_db) as client:
        assert client.keys("eventbus-test-*") == []  # each test's keys deleted after it
        assert client.keys("eventbus:*") == []  # nothing under the bus's own prefix


def test_running_app_bus_without_an_asgi_app_fixture_it_says_what_to_define(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile("def test_x(running_app_bus):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*define a fixture `eventbus_asgi_app`*"])
