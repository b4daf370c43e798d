"""Decoding a read of entries in a wire profile's own format (`eventbus.profiles.Codec` that is
not native, e.g. Verse's ``msg``): what `Decoding.prepare` does for eventbus's format, entry by
entry through the profile's codec. A `Decoding` of such a profile uses `prepare_foreign` as its
``prepare`` (picked once, when it is made).

**The order key.** The consumer's per-resource queues, its parked check and its dead letters
read an entry's resource ID from its plain ``rid`` field, which eventbus's format carries and a
foreign one may not (Verse's ``msg`` is the only field of a Verse entry). So each decoded entry
gets one, written into its field map before the read is queued: the resource ID it carries
(eventbus's publishers of the profile send it), or, for an entry that carries none (Verse's
publishers hash the resource ID but do not send it), `NO_RESOURCE`: the entries of a shard
without one then run one after another in entry order, as Verse's own consumers run them,
rather than concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_RESOURCE
from eventbus.protocol.dead_letters import is_control

if TYPE_CHECKING:
    from eventbus.consumer.decoding import Decoding
    from eventbus.consumer.delivery import Delivery
    from eventbus.profiles import Codec

NO_RESOURCE = b"\x00"
"""The order key of a foreign entry without resource ID (its `Context.resource_id` is "")."""


def prepare_foreign(decoding: Decoding, codec: Codec, batch: Sequence[Delivery]) -> None:
    """Decode and validate the entries of one read with `codec`, as `Decoding.prepare` does:
    sets each `Delivery`'s `env`, `event` and `call`, or `error` (undecodable, an unknown
    type, a payload the model refuses, a bad reply address), and its ``rid`` field (the module
    docstring). Control entries (eventbus's format, written by ``eventbus dlq``) are left to
    their turn. The event time is the entry ID's when the format carries none. Raises
    nothing."""
    routes = decoding.sub.routes
    by_type, fallback = routes.by_type, routes.fallback
    limit = decoding.max_decoded_bytes
    for d in batch:
        fields = d.fields
        if is_control(fields):
            continue
        try:
            env = codec.decode(fields, max_bytes=limit, entry_id=d.entry_id.decode())
        except DecodeError as exc:
            d.error = exc
            continue
        fields[F_RESOURCE] = env.resource_id.encode("utf-8") or NO_RESOURCE
        d.env = env
        if env.headers and (bad := decoding.bad_request(env)) is not None:
            d.error = bad
            continue
        route = by_type.get(env.event_type, fallback)
        if route is None:
            d.error = decoding.unknown(env.event_type)
            continue
        d.call = route.call
        try:
            d.event = route.convert(env.payload)
        except DecodeError as exc:
            d.error = exc
