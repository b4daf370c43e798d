"""`eventbus.publishing.encoding.Encoder`, the pure part of publishing: `prepare` (encode, choose
the shard stream, refuse what consumers would refuse), without Redis. Sending runs against
redis-server in `tests/integration/test_publish.py`."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from eventbus import Settings, shard_of
from eventbus.errors import (
    ConfigError,
    InvalidEvent,
    PayloadTooLarge,
    ReservedEventType,
)
from eventbus.protocol.codec import Envelope, decode_entry, new_event_id
from eventbus.protocol.dictionaries import Dictionaries
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.encoding import Encoder

TOPIC = TopicConfig("orders", 8, 10_000)


class OrderPlaced(BaseModel):
    order_id: str
    note: str = ""


def encoder(**settings: Any) -> Encoder:
    return Encoder(Settings(**settings), Keys(), Dictionaries(None, Keys()))  # type: ignore[arg-type]


def envelope(**overrides: Any) -> Envelope:
    values: dict[str, Any] = {
        "resource_id": "o-1",
        "event_type": "OrderPlaced",
        "event_id_bytes": new_event_id(),
        "published_at_ms": 1,
        "headers": {},
        "payload": {"order_id": "o-1"},
    }
    values.update(overrides)
    return Envelope(**values)


def test_prepare_encodes_the_event_for_its_resources_shard() -> None:
    p = encoder()
    for rid in ("o-1", "o-2", "customer/ü"):
        stream, fields = p.prepare(TOPIC, OrderPlaced(order_id=rid), rid, {"trace": "t1"})
        assert stream == Keys().stream("orders", shard_of(rid, 8))
        env = decode_entry(fields)
        assert (env.resource_id, env.event_type, env.headers) == (
            rid,
            "OrderPlaced",
            {"trace": "t1"},
        )
        assert env.payload == {"order_id": rid, "note": ""}


def test_large_payloads_are_compressed_and_still_decode() -> None:
    p = encoder(compress_threshold_bytes=64)
    _, small = p.prepare(TOPIC, OrderPlaced(order_id="o"), "o")
    _, large = p.prepare(TOPIC, OrderPlaced(order_id="o", note="n" * 2000), "o")
    assert len(large[b"data"]) < 2000  # compressed
    assert small[b"data"][:1] != large[b"data"][:1]  # another format byte
    assert decode_entry(large).payload["note"] == "n" * 2000


@pytest.mark.parametrize(
    ("event", "rid", "error"),
    [
        ({"order_id": "o"}, "o", ConfigError),  # not a model
        (OrderPlaced(order_id="o"), "", ConfigError),  # no resource
    ],
)
def test_prepare_refuses_bad_arguments(event: Any, rid: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        encoder().prepare(TOPIC, event, rid)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"event_type": "__eventbus.unpark"}, ReservedEventType),
        ({"event_type": ""}, InvalidEvent),
        ({"headers": {"n": 1}}, InvalidEvent),
        ({"headers": ["not", "a", "dict"]}, InvalidEvent),
        ({"resource_id": "bad\udcff"}, InvalidEvent),  # a lone surrogate: not UTF-8 text
        ({"headers": {"k": "\udcff"}}, InvalidEvent),
    ],
)
def test_prepare_envelope_refuses_what_consumers_would_refuse(
    overrides: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        encoder().prepare_envelope(TOPIC, envelope(**overrides))


def test_an_entry_over_max_payload_bytes_is_refused_with_its_size() -> None:
    p = encoder(max_payload_bytes=1024, compress_threshold_bytes=1 << 20)
    with pytest.raises(PayloadTooLarge) as caught:
        p.prepare(TOPIC, OrderPlaced(order_id="o", note="n" * 2000), "o")
    assert "orders" in str(caught.value)
