"""Private Redis topologies on loopback for this repository's tests, benchmarks and examples:
one ``redis-server`` (`localredis.server`), a Redis Cluster with replicas (`localredis.cluster`)
and a Sentinel topology (`localredis.sentinel`). Needs the ``redis-server`` binary on PATH.

Not part of the eventbus wheel: users' tests get an in-memory bus (`eventbus.testing`) or are
given a Redis URL (the pytest plugin's ``--eventbus-redis``); they need no launcher of ours.
"""
