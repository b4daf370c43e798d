"""The offloader against Redis's limits and a misconfigured store: a long shard is trimmed in one
round (an approximate ``XTRIM`` evicts at most ``LIMIT`` entries per call), and an ``http://``
endpoint in ``AWS_ENDPOINT_URL`` without ``AWS_ALLOW_HTTP`` is a clear error, not a retry loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from tier_support import fast_tier, make_bus, publish_ticks

from eventbus.tier.offloader import offload_until_caught_up
from eventbus.tier.store import open_store

pytestmark = pytest.mark.integration


def test_an_approximate_trim_empties_a_long_shard_in_one_round(
    redis_db: str, tmp_path: Path
) -> None:
    """30,000 archived entries on one shard: Redis's default LIMIT stopped the one approximate
    XTRIM per round at 10,000 (20,000 stayed after ``offload --once``)."""

    async def go() -> tuple[int, int]:
        bus = make_bus(redis_db, shards=1)
        async with bus:
            await publish_ticks(bus, "long", 30_000)
            tier = fast_tier(trim_exact=False, segment_max_entries=100_000)
            stats = await offload_until_caught_up(
                bus.redis,
                open_store(str(tmp_path)),
                settings=bus.settings,
                tier=tier,
                timeout_s=120,
            )
            left = await bus.redis.xlen(bus.keys.stream("long", 0))
        await bus.aclose()
        return stats.entries, left

    archived, left = anyio.run(go)
    assert archived == 30_000
    assert left < 100  # approximate: at most the last, partly archived stream node stays


def test_offload_once_refuses_a_plain_http_endpoint_without_allow_http(
    redis_db: str, s3_endpoint: str, tmp_path: Path
) -> None:
    async def publish() -> None:
        bus = make_bus(redis_db, shards=1)
        async with bus:
            await publish_ticks(bus, "plain", 10)
        await bus.aclose()

    anyio.run(publish)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=s3_endpoint,  # http://127.0.0.1:<port>
    )
    cmd = [sys.executable, "-m", "eventbus.cli", "offload", "--once", "--redis-url", redis_db]
    proc = subprocess.run(
        [*cmd, "--store", "s3://eventbus-test/plain"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # it used to retry for ever
    )
    assert proc.returncode == 1, proc.stderr
    assert "AWS_ALLOW_HTTP" in proc.stderr and "Traceback" not in proc.stderr
