"""Where ``WAIT`` goes for `publish_replicas`: to every node that took an ``XADD`` of the batch.

``WAIT n timeout`` counts the replicas that acknowledged the *calling connection's* writes
(https://redis.io/docs/latest/commands/wait/), so it must follow the ``XADD``s on the connection
that carried them. On one Redis the batch is one connection. On a Redis Cluster redis-py's
pipeline sends each node's commands on one connection of that node, in order, so one ``WAIT``
per node that stored an entry of the batch (``target_nodes=`` that node) runs right after that
node's ``XADD``s: the batch is confirmed only when every one of those nodes reports enough
replicas.

Limit: an ``XADD`` that met ``MOVED``/``ASK`` (a slot moving during the batch) is re-sent by
redis-py on its own, outside the pipeline; no ``WAIT`` covers that one write.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def wait_targets(redis: Any, streams: Iterable[str | None]) -> list[dict[str, Any]]:
    """The keyword arguments of each ``WAIT`` to add to a pipeline of XADDs to `streams`:
    ``[{}]`` (one WAIT, on the pipeline's connection) for a single-node client, one
    ``{"target_nodes": node}`` per distinct primary on a Cluster client."""
    if not hasattr(redis, "get_node_from_key"):
        return [{}]
    nodes: dict[str, Any] = {}
    for stream in streams:
        node = redis.get_node_from_key(stream)
        nodes.setdefault(node.name, node)
    return [{"target_nodes": node} for node in nodes.values()]
