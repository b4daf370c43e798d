"""Every module of eventbus/ has its tests where a reader looks for them: a test module named
after it (``test_<module>.py``), a test that imports it, or, listed in `COVERED_BY`, the shared
case file or end-to-end test that exercises it (the consumer's behaviour runs on fakeredis and
on redis-server from one case file; the CLI commands run as subprocesses)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COVERED_BY: dict[str, list[str]] = {
    "eventbus.cli.__main__": ["tests/integration/test_deadlines.py"],
    "eventbus.cli.connection": ["tests/integration/test_cli.py"],
    "eventbus.cli.inspect": ["tests/integration/test_cli.py"],
    "eventbus.cli.placement": ["tests/integration/test_cli.py"],
    "eventbus.cli.run": [
        "tests/integration/test_cli_dev.py",
        "tests/integration/test_metrics_health.py",
    ],
    "eventbus.cli.settings": ["tests/unit/test_cli_settings.py"],
    "eventbus.config.settings": ["tests/unit/test_config.py"],
    "eventbus.declarations": ["tests/unit/test_app_api.py", "tests/unit/test_router.py"],
    "eventbus.consumer.batch_call": ["tests/cases/batch_cases.py"],
    "eventbus.consumer.batching": ["tests/cases/batch_cases.py"],
    "eventbus.consumer.broadcast": ["tests/cases/broadcast_cases.py"],
    "eventbus.consumer.cluster_reads": ["tests/integration/test_cluster.py"],
    "eventbus.consumer.controls": ["tests/cases/failure_policy_cases.py"],
    "eventbus.consumer.decoding": ["tests/unit/consumer/test_handling.py"],
    "eventbus.consumer.dedup": ["tests/unit/consumer/test_handling.py"],
    "eventbus.consumer.engine": ["tests/cases/consume_cases.py"],
    "eventbus.consumer.failures": ["tests/cases/failure_policy_cases.py"],
    "eventbus.consumer.foreign": ["tests/cases/verse_profile_cases.py"],
    "eventbus.consumer.open_ownership": ["tests/cases/broadcast_cases.py"],
    "eventbus.consumer.pipeline": ["tests/cases/consume_cases.py"],
    "eventbus.consumer.raw_replies": [
        "tests/integration/test_cluster.py",
        "tests/unit/consumer/test_raw_replies.py",
    ],
    "eventbus.consumer.reading": [
        "tests/cases/consume_cases.py",
        "tests/integration/test_fenced_reads.py",
    ],
    "eventbus.consumer.registration": [
        "tests/unit/test_app_api.py",
        "tests/cases/routing_cases.py",
    ],
    "eventbus.consumer.runner": ["tests/cases/consume_cases.py"],
    "eventbus.consumer.signature": ["tests/unit/test_app_api.py"],
    "eventbus.consumer.supervision": ["tests/integration/test_redis_faults.py"],
    "eventbus.protocol.dead_letters": ["tests/unit/test_dlq.py"],
    "eventbus.publishing.cluster_wait": ["tests/integration/test_cluster_replicas.py"],
    "eventbus.publishing.sending": [
        "tests/integration/test_publish_order.py",
        "tests/integration/test_publish_wakeups.py",
        "tests/integration/test_publish_redis_down.py",
    ],
    "eventbus.publishing.topic_setup": [
        "tests/integration/test_publish.py",
        "tests/integration/test_publish_redis_down.py",
    ],
    "eventbus.session": ["tests/integration/test_reentry.py"],
    "eventbus.spark.decode": ["tests/spark/test_batch.py"],
    "eventbus.spark.jvm": ["tests/spark/test_native.py"],
    "eventbus.spark.names": ["tests/unit/test_spark_options.py"],
    "eventbus.spark.schema": ["tests/spark/test_batch.py"],
    "eventbus.spark.source": ["tests/spark/test_batch.py"],
    "eventbus.testing.recording": ["tests/integration/test_pytest_plugin.py"],
    "eventbus.tier.archived": ["tests/integration/tier/test_tier_offload.py"],
    "eventbus.tier.catchup_handles": ["tests/integration/tier/test_tier_catchup.py"],
    "eventbus.tier.catchup_shard": ["tests/integration/tier/test_tier_catchup.py"],
    "eventbus.tier.cli.common": ["tests/integration/tier/test_tier_cli.py"],
    "eventbus.tier.cli.export": ["tests/integration/tier/test_tier_cli.py"],
    "eventbus.tier.cli.offload": ["tests/integration/tier/test_tier_cli.py"],
    "eventbus.tier.cli.replay": ["tests/integration/tier/test_tier_cli.py"],
    "eventbus.tier.offload_state": ["tests/integration/tier/test_tier_offload.py"],
    "eventbus.tier.shard_gaps": [
        "tests/integration/tier/test_checkpoints.py",
        "tests/integration/tier/test_tier_safety.py",
    ],
    "eventbus.tier.shard_offload": ["tests/integration/tier/test_tier_offload.py"],
    "eventbus.tier.topic_offload": ["tests/integration/tier/test_tier_offload.py"],
}
"""Modules tested under another name: module -> the test files that exercise it."""


def _modules() -> list[str]:
    """The modules of eventbus/, packages' ``__init__`` left out (they only re-export)."""
    found = []
    for path in sorted((ROOT / "eventbus").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] != "__init__":
            found.append(".".join(parts))
    return found


def _tests() -> tuple[set[str], set[str]]:
    """The names of the test files, and the eventbus modules (and names) they import."""
    names, imported = set(), set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eventbus"):
                imported |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("eventbus")}
    return names, imported


def test_every_module_has_its_tests() -> None:
    names, imported = _tests()
    untested = [
        m
        for m in _modules()
        if m not in imported and f"test_{m.rpartition('.')[2]}" not in names and m not in COVERED_BY
    ]
    assert untested == [], "name a test after these modules, or list them in COVERED_BY"


def test_the_listed_test_files_exist() -> None:
    modules = set(_modules())
    for module, files in COVERED_BY.items():
        assert module in modules, f"{module} is gone: drop it from COVERED_BY"
        for name in files:
            assert (ROOT / name).is_file(), f"{name} (for {module}) is gone"
