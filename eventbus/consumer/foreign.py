"""Decoding a read of entries in a wire profile's own format (`eventbus.profiles.Codec` that is
not native, e.g. Verse's ``msg``): what `Decoding.prepare` does for eventbus's format, entry by
entry through the profile's codec. A `Decoding` of such a profile uses `prepare_foreign` as its
``prepare`` (picked once, when it is made).

**The shard is the unit of order.** The consumer queues an entry behind the earlier entries
of the resource named by its plain ``rid`` field, which eventbus's format carries and Verse's
does not (``msg`` is a Verse entry's only field): Verse's publishers hash the resource ID but do
not send it, so entries of one resource, some from Verse's publishers and some from eventbus's
(which send it in a header), could not be told to be the same resource. Every entry of a foreign
format is therefore queued under one key, `SHARD_ORDER`, written into its field map before the
read is queued: a shard's entries run one after another, in entry order, as Verse's own
consumers run them. (`Context.resource_id` is still the resource ID an entry carries, "" for
Verse's.) A parked resource would need the per-resource key: `EventBus` refuses
``on_failure="park"`` in such a profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from eventbus.errors import undecodable
from eventbus.protocol.codec import F_RESOURCE
from eventbus.protocol.dead_letters import is_control

if TYPE_CHECKING:
    from eventbus.consumer.decoding import Decoding
    from eventbus.consumer.delivery import Delivery
    from eventbus.profiles import Codec

SHARD_ORDER = b"\x00"
"""The ``rid`` a foreign entry is queued under (the queue key is (shard, rid)): one per shard."""


def prepare_foreign(decoding: Decoding, codec: Codec, batch: Sequence[Delivery]) -> None:
    """Decode the entries of one read with `codec`, then `Decoding.route` them, as
    `Decoding.prepare` does: sets each `Delivery`'s `env`, `event` and `call`, or `error`
    (undecodable: whatever the codec raised, as `undecodable`; an unknown type, a payload the
    model refuses, a bad reply address), and its ``rid`` field to `SHARD_ORDER` (the module
    docstring). Control entries (eventbus's format,
    written by ``eventbus dlq``) are left to their turn. The event time is the entry ID's when
    the format carries none. Raises nothing."""
    limit = decoding.max_decoded_bytes
    decoded: list[Delivery] = []
    for d in batch:
        fields = d.fields
        if is_control(fields):
            continue
        fields[F_RESOURCE] = SHARD_ORDER
        try:
            d.env = codec.decode(fields, max_bytes=limit, entry_id=d.entry_id.decode())
        except Exception as exc:  # whatever a codec raises stops this entry, not the consumer
            d.error = undecodable(exc)
            continue
        decoded.append(d)
    decoding.route(decoded)
