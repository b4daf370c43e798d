"""`eventbus.publishing.publisher.Publisher` made without Redis; what it encodes is
tests/unit/test_encoding.py's, what it sends runs against redis-server in
`tests/integration/test_publish.py`."""

from __future__ import annotations

from eventbus import Settings
from eventbus.protocol.keys import Keys
from eventbus.publishing.publisher import Publisher


def test_wait_for_replicas_is_accepted_on_a_cluster() -> None:
    """`publish_replicas` works on a Cluster: WAIT goes to each node that took XADDs of a batch
    (eventbus.publishing.cluster_wait; tests/integration/test_cluster_replicas.py checks it on
    replicas)."""
    settings = Settings(cluster=True, publish_replicas=1)
    assert Publisher(None, settings, Keys(), registry=None) is not None  # type: ignore[arg-type]
