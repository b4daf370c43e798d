"""The consumer: one `Consumer` per subscription runs lock rounds, reads its shards, and hands
each entry to the handling path shared with catch-up.

Modules, in the order an entry meets them: `context` (Subscription, RetryPolicy, HandlerCall,
Context), `shards` (the held-shard table), `lease` (lease and heartbeats), `reading` (groups,
PEL recovery, XREADGROUP), `queues` (per-resource queues and workers), `delivery` and `handling`
(the handling path), `failures` (dead letters, parking, control entries), `acks` (batched
XACK), `engine` (the round that ties them together).
"""

from eventbus.consumer.catching_up import CatchUpHook
from eventbus.consumer.context import Context, Handler, HandlerCall, RetryPolicy, Subscription
from eventbus.consumer.engine import Consumer
from eventbus.locking.locks import new_member_id as new_consumer_id

__all__ = [
    "CatchUpHook",
    "Consumer",
    "Context",
    "Handler",
    "HandlerCall",
    "RetryPolicy",
    "Subscription",
    "new_consumer_id",
]
