"""The operator commands against a real redis-server: publish, tail, stats."""

from __future__ import annotations

import json

from support import on_cluster, resources_per_shard, sync_client
from typer.testing import CliRunner

from eventbus.cli import app

RUNNER = CliRunner(env={"COLUMNS": "200"})


def test_publish_tail_and_stats(redis_db: str) -> None:
    url = ["--redis-url", redis_db]
    ids = []
    for i in range(3):
        out = RUNNER.invoke(
            app,
            [
                "publish",
                "orders",
                "--type",
                "OrderPlaced",
                "--resource-id",
                f"o-{i}",
                "--data",
                json.dumps({"n": i}),
                *url,
            ],
        )
        assert out.exit_code == 0, out.output
        ids.append(out.output.strip())
    assert len(set(ids)) == 3

    tailed = RUNNER.invoke(app, ["tail", "orders", "--count", "10", *url])
    assert tailed.exit_code == 0, tailed.output
    rows = [json.loads(line) for line in tailed.output.splitlines()]
    assert sorted(r["entry_id"] for r in rows) == sorted(ids)
    assert {r["resource_id"]: r["payload"] for r in rows} == {f"o-{i}": {"n": i} for i in range(3)}

    # a group that has read and acked everything on its shards shows no lag and no pending
    with sync_client(redis_db) as r:
        for key in [f"eventbus:stream:orders:{s}" for s in range(16)]:
            if not r.exists(key):
                continue
            r.xgroup_create(key, "billing", id="0")
            for _, entries in r.xreadgroup("billing", "c", {key: ">"}) or []:
                r.xack(key, "billing", *[eid for eid, _ in entries])
    stats = RUNNER.invoke(app, ["stats", *url])
    assert stats.exit_code == 0, stats.output
    billing = next(line for line in stats.output.splitlines() if "billing" in line)
    cells = [c.strip() for c in billing.replace("│", "|").split("|") if c.strip()]
    assert cells[:3] == ["billing", "0", "0"]  # group, lag, pending
    if on_cluster():  # per-node placement of the shard streams and the coordination node
        assert "placement" in stats.output and "{eventbus}" in stats.output
        with sync_client(redis_db) as r:
            nodes = {r.get_node_from_key(f"eventbus:stream:orders:{s}").name for s in range(16)}
        assert len(nodes) == 3 and all(n in stats.output for n in nodes)
    else:
        assert "placement" not in stats.output


def _publish(url: list[str], resource: str, n: int) -> list[str]:
    """Publish `n` events of `resource` to topic "orders" with the CLI; their entry IDs."""
    ids = []
    for _ in range(n):
        out = RUNNER.invoke(
            app,
            ["publish", "orders", "--type", "T", "--resource-id", resource, "--data", "{}", *url],
        )
        assert out.exit_code == 0, out.output
        ids.append(out.output.strip())
    return ids


def _lag_cell(url: list[str]) -> str:
    stats = RUNNER.invoke(app, ["stats", *url])
    assert stats.exit_code == 0, stats.output
    billing = next(line for line in stats.output.splitlines() if "billing" in line)
    return [c.strip() for c in billing.replace("│", "|").split("|") if c.strip()][1]


def test_stats_shows_a_lag_redis_cannot_compute_as_unknown(redis_db: str) -> None:
    """Redis answers a null lag (XINFO GROUPS: "null when it cannot be computed") for a stream
    with an entry deleted after the group's last-delivered ID. `stats` counted it as 0, so a
    group with 3 entries left to read looked caught up; now it shows "?", and ">=N" beside the
    lag N the other shard streams know."""
    url = ["--redis-url", redis_db]
    a, b = resources_per_shard(16)[:2]  # two resources on two shard streams
    ids = _publish(url, a, 5)
    stream = "eventbus:stream:orders:0"
    with sync_client(redis_db) as r:
        r.xgroup_create(stream, "billing", id="0")
        r.xreadgroup("billing", "c", {stream: ">"}, count=1)
        r.xdel(stream, ids[2])  # an unread entry deleted: 3 left to read
        assert r.xinfo_groups(stream)[0]["lag"] is None
    assert _lag_cell(url) == "?"
    _publish(url, b, 3)
    with sync_client(redis_db) as r:
        r.xgroup_create("eventbus:stream:orders:1", "billing", id="0")
        r.xreadgroup("billing", "c", {"eventbus:stream:orders:1": ">"}, count=1)
    assert _lag_cell(url) == ">=2"


def test_publish_refuses_an_empty_resource_id(redis_db: str) -> None:
    url = ["--redis-url", redis_db]
    first = RUNNER.invoke(
        app, ["publish", "t", "--type", "T", "--resource-id", "r", "--data", "{}", *url]
    )
    assert first.exit_code == 0
    empty = RUNNER.invoke(app, ["publish", "t", "--type", "T", "--resource-id", "", *url])
    assert empty.exit_code == 1 and "resource_id must be a non-empty string" in empty.output
