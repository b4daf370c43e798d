"""``eventbus stats`` on a Redis Cluster: which primary holds which shard streams, and which one
holds the coordination hashtag (topic registry, locks, liveness: every lock round and heartbeat
of the deployment goes there), or, with ``coordination_slots="topic"``, which one holds each
topic's own ``{<hashtag>:<topic>}`` (its lock rounds and heartbeats)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from eventbus.protocol.keys import Keys


async def placement_table(redis: Any, keys: Keys, topics: dict[str, int]) -> Table | None:
    """A table of primaries: shard streams per topic, and the coordination node; None when
    `redis` is not a Cluster client."""
    if not hasattr(redis, "get_node_from_key"):
        return None
    if not redis.nodes_manager.slots_cache:
        await redis.initialize()
    tags = {redis.get_node_from_key(keys.topics()).name: [f"{{{keys.hashtag}}}"]}
    if keys.slots == "topic":
        for topic in sorted(topics):
            node = redis.get_node_from_key(keys.members(topic, "_")).name
            tags.setdefault(node, []).append(keys.topic_hashtag(topic))
    rows: dict[str, dict[str, list[int]]] = {n.name: {} for n in redis.get_primaries()}
    for topic, count in sorted(topics.items()):
        for s in range(count):
            node = redis.get_node_from_key(keys.stream(topic, s)).name
            rows.setdefault(node, {}).setdefault(topic, []).append(s)
    table = Table("node", "coordination", "topic", "shards", "shard streams", title="placement")
    for node in sorted(rows):
        mark = " ".join(tags.get(node, []))
        by_topic = rows[node] or {"": []}
        for i, (topic, shards) in enumerate(sorted(by_topic.items())):
            table.add_row(
                node if i == 0 else "",
                mark if i == 0 else "",
                topic,
                str(len(shards)) if topic else "0",
                ",".join(map(str, shards)),
            )
    return table
