"""pytest plugin: a running bus per test, in memory or on a real Redis.

Installed with eventbus (entry point ``pytest11``: ``eventbus``), it adds:

* the fixture ``running_bus``: your `EventBus` (from the fixture ``eventbus_app``, which you
  define) running with all its subscribers for the test (`eventbus.testing.running`), as a
  `TestBus`: ``publish``, ``drain``, ``handled``, ``events``, ``published``, ``dead_letters``;
* fail-fast by default: a handler's exception is re-raised by ``drain()`` (and at the end of the
  test) as `HandlerFailed`, not retried nor dead-lettered. Mark a test
  ``@pytest.mark.eventbus(fail_fast=False)`` to run the subscribers' own retry and
  dead-letter policy;
* where it runs: in memory (fakeredis with Lua) unless ``--eventbus-redis URL`` or the
  environment variable ``EVENTBUS_TEST_REDIS_URL`` names a real server; there each test's keys
  get their own prefix, deleted after the test (the database is not flushed).
* the fixture ``running_app_bus`` for sync tests of a FastAPI (or Starlette) app through
  ``TestClient``: the same bus, with the same options, started in the app's lifespan on
  TestClient's event loop (`eventbus.testing.running_in_app`), as an `AppTestBus` whose
  ``drain()``, ``published()``... wait from the test's thread. Define ``eventbus_asgi_app``
  (your app) besides ``eventbus_app``, and enter ``TestClient(app)`` in the test.

::

    # conftest.py
    import pytest
    from myservice.app import bus

    @pytest.fixture
    def eventbus_app():
        return bus

    # test_billing.py
    import pytest
    pytestmark = pytest.mark.anyio

    async def test_billing(running_bus):
        await running_bus.publish("orders", OrderPlaced(...), resource_id="o-1")
        await running_bus.drain()
        assert running_bus.events("orders") == [OrderPlaced(...)]

The async fixture runs under anyio's pytest plugin (``pytest.mark.anyio``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from eventbus.app import EventBus
    from eventbus.testing import AppTestBus, TestBus

ENV_URL = "EVENTBUS_TEST_REDIS_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("eventbus")
    group.addoption(
        "--eventbus-redis",
        metavar="URL",
        default=None,
        help=f"run the running_bus fixture on this Redis instead of in memory (or ${ENV_URL})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "eventbus(fail_fast=True): options of the running_bus and running_app_bus fixtures "
        "(fail_fast=False: the "
        "subscribers' retry and dead-letter policy instead of re-raising handler errors)",
    )


@pytest.fixture
def eventbus_redis_url(request: pytest.FixtureRequest) -> str | None:
    """The Redis the ``running_bus`` fixture runs on (None: in memory)."""
    url: str | None = request.config.getoption("--eventbus-redis") or os.environ.get(ENV_URL)
    return url or None


@pytest.fixture
def eventbus_app() -> EventBus:
    """Your application's `EventBus`: define this fixture in your conftest.py."""
    raise pytest.UsageError(
        "the running_bus fixture needs your EventBus: define a fixture `eventbus_app` "
        "returning it (e.g. in conftest.py)"
    )


@pytest.fixture
def eventbus_asgi_app() -> Any:
    """Your FastAPI (or Starlette) application, for ``running_app_bus``: define this fixture in
    your conftest.py."""
    raise pytest.UsageError(
        "the running_app_bus fixture needs your FastAPI app: define a fixture "
        "`eventbus_asgi_app` returning it (e.g. in conftest.py)"
    )


def _options(request: pytest.FixtureRequest, url: str | None) -> tuple[bool, str | None]:
    """fail_fast from the test's ``pytest.mark.eventbus``, and a key prefix of its own on a
    real Redis (None in memory). Raises `pytest.UsageError` for an unknown mark option."""
    marker = request.node.get_closest_marker("eventbus")
    options: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    fail_fast = bool(options.pop("fail_fast", True))
    if options:
        raise pytest.UsageError(f"unknown options of pytest.mark.eventbus: {sorted(options)}")
    return fail_fast, f"eventbus-test-{uuid.uuid4().hex[:12]}" if url else None


@pytest.fixture
def running_app_bus(
    eventbus_app: EventBus,
    eventbus_asgi_app: Any,
    eventbus_redis_url: str | None,
    request: pytest.FixtureRequest,
) -> Iterator[AppTestBus]:
    """`eventbus_app` running in `eventbus_asgi_app`'s lifespan while the test has
    ``TestClient(app)`` entered; see the module docstring."""
    import anyio

    from eventbus.testing import running_in_app

    fail_fast, prefix = _options(request, eventbus_redis_url)
    try:
        with running_in_app(
            eventbus_app,
            eventbus_asgi_app,
            redis=eventbus_redis_url,
            fail_fast=fail_fast,
            key_prefix=prefix,
        ) as tb:
            yield tb
    finally:
        if eventbus_redis_url and prefix:
            anyio.run(_delete_keys, eventbus_redis_url, prefix)


@pytest.fixture
async def running_bus(
    eventbus_app: EventBus, eventbus_redis_url: str | None, request: pytest.FixtureRequest
) -> AsyncIterator[TestBus]:
    """`eventbus_app` running for this test; see the module docstring."""
    from eventbus.testing import running

    fail_fast, prefix = _options(request, eventbus_redis_url)
    try:
        async with running(
            eventbus_app, redis=eventbus_redis_url, fail_fast=fail_fast, key_prefix=prefix
        ) as tb:
            yield tb
    finally:
        if eventbus_redis_url and prefix:
            await _delete_keys(eventbus_redis_url, prefix)


async def _delete_keys(url: str, prefix: str) -> None:
    import redis.asyncio

    from eventbus.client.credentials import from_url

    client = from_url(redis.asyncio.Redis, url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
    finally:
        await client.aclose()
