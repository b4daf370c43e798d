"""The operator commands against a real redis-server: publish, tail, stats."""

from __future__ import annotations

import json

from support import on_cluster, sync_client
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


def test_publish_refuses_an_empty_resource_id(redis_db: str) -> None:
    url = ["--redis-url", redis_db]
    first = RUNNER.invoke(
        app, ["publish", "t", "--type", "T", "--resource-id", "r", "--data", "{}", *url]
    )
    assert first.exit_code == 0
    empty = RUNNER.invoke(app, ["publish", "t", "--type", "T", "--resource-id", "", *url])
    assert empty.exit_code == 1 and "resource_id must be a non-empty string" in empty.output
