"""The consumer: one `Consumer` per subscription, assembled from an `Ownership` (`ownership`:
lock rounds, lease, held-shard table, recovery, release: the fence) and a `Pipeline`
(`pipeline`: `reading` -> `decoding` -> `queues` and `runner` -> `acks`), run by `engine` and
`supervision`; a broadcast one (`broadcast`) is an open ownership (`open_ownership`: no lock, no
lease, its own read positions) with the same pipeline, reading with ``XREAD`` from those
positions (`position_reads`) instead of `reading`'s ``XREADGROUP``.
Each entry goes through the handling path shared with catch-up (`handling`, `delivery`,
`failures`). docs/architecture.md lists every module and the path of an entry.
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
