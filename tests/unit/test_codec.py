"""Entry codec: round trips, compression threshold, and every way decoding can fail."""

from __future__ import annotations

import random
import threading
import uuid

import msgpack
import pytest
import zstandard
from pydantic import BaseModel

from eventbus.errors import DecodeError
from eventbus.protocol.codec import (
    ENVELOPE_VERSION,
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    FORMAT_MSGPACK,
    FORMAT_MSGPACK_ZSTD,
    Envelope,
    decode_entry,
    encode_entry,
    encoded_size,
    envelope_of,
    event_type_of,
    new_event_id,
)


class OrderPlaced(BaseModel):
    order_id: str
    total_cents: int
    note: str = ""


class Renamed(BaseModel):
    __event_type__ = "orders.renamed.v2"
    x: int


def _envelope(payload: object, headers: dict[str, str] | None = None) -> Envelope:
    return Envelope(
        resource_id="order-ü-1",
        event_type="OrderPlaced",
        event_id_bytes=uuid.uuid4().bytes,
        published_at_ms=1_700_000_000_123,
        headers=headers or {"traceparent": "00-abc-def-01"},
        payload=payload,
    )


def _body(fields: dict[bytes, bytes]) -> bytes:
    """The MessagePack body of an encoded entry, decompressed if needed (independent of
    `decode_entry`)."""
    data = fields[F_DATA]
    if data[0] == FORMAT_MSGPACK_ZSTD:
        return zstandard.ZstdDecompressor().decompress(data[1:])
    return data[1:]


def _with_data(data: bytes) -> dict[bytes, bytes]:
    return {F_RESOURCE: b"r", F_TYPE: b"T", F_DATA: data}


def _packed(**env: object) -> bytes:
    return bytes([FORMAT_MSGPACK]) + msgpack.packb(env, use_bin_type=True)


def test_small_envelope_round_trips_uncompressed() -> None:
    env = _envelope({"order_id": "o1", "total_cents": 1299})
    fields = encode_entry(env, compress_threshold=1024)

    assert fields[F_RESOURCE] == "order-ü-1".encode()
    assert fields[F_TYPE] == b"OrderPlaced"
    assert fields[F_DATA][0] == FORMAT_MSGPACK
    assert decode_entry(fields) == env


def test_large_envelope_is_zstd_compressed_and_round_trips() -> None:
    env = _envelope({"order_id": "o1", "total_cents": 1, "note": "x" * 5000})
    fields = encode_entry(env, compress_threshold=1024)

    assert fields[F_DATA][0] == FORMAT_MSGPACK_ZSTD
    assert len(fields[F_DATA]) < 1000  # 5000 repeated bytes compress well
    assert decode_entry(fields) == env


def test_threshold_is_inclusive_and_zero_compresses_everything() -> None:
    env = _envelope({"k": 1})
    body_len = len(_body(encode_entry(env, compress_threshold=1 << 30)))

    assert encode_entry(env, compress_threshold=body_len)[F_DATA][0] == FORMAT_MSGPACK_ZSTD
    assert encode_entry(env, compress_threshold=body_len + 1)[F_DATA][0] == FORMAT_MSGPACK
    assert encode_entry(env, compress_threshold=0)[F_DATA][0] == FORMAT_MSGPACK_ZSTD


def test_body_follows_the_documented_map() -> None:
    env = _envelope({"a": [1, 2]}, headers={"h": "v"})
    body = msgpack.unpackb(_body(encode_entry(env)), raw=False)

    assert body == {
        "v": ENVELOPE_VERSION,
        "id": env.event_id_bytes,
        "ts": env.published_at_ms,
        "h": {"h": "v"},
        "p": {"a": [1, 2]},
    }


def test_envelope_of_model_carries_json_mode_payload_and_fresh_ids() -> None:
    a = envelope_of("o1", OrderPlaced(order_id="o1", total_cents=5), {"k": "v"})
    b = envelope_of("o1", OrderPlaced(order_id="o1", total_cents=5))

    assert a.event_type == "OrderPlaced"
    assert a.payload == {"order_id": "o1", "total_cents": 5, "note": ""}
    assert a.headers == {"k": "v"} and b.headers == {}
    assert a.event_id != b.event_id and len(a.event_id_bytes) == 16
    assert a.event_id.version == 4
    decoded = decode_entry(encode_entry(a))
    assert OrderPlaced.model_validate(decoded.payload) == OrderPlaced(order_id="o1", total_cents=5)


def test_event_type_name_can_be_overridden() -> None:
    assert event_type_of(OrderPlaced) == "OrderPlaced"
    assert event_type_of(Renamed) == "orders.renamed.v2"


def test_encoded_size_counts_names_and_values() -> None:
    fields = {b"ab": b"123", b"c": b""}
    assert encoded_size(fields) == 6


# -- every failure is a DecodeError -------------------------------------------------------------
GOOD = encode_entry(_envelope({"x": 1}), compress_threshold=1 << 30)
GOOD_Z = encode_entry(_envelope({"x": "y" * 4000}), compress_threshold=0)
ID16 = b"\x01" * 16


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({F_TYPE: b"T", F_DATA: GOOD[F_DATA]}, id="missing-rid"),
        pytest.param({F_RESOURCE: b"r", F_DATA: GOOD[F_DATA]}, id="missing-type"),
        pytest.param({F_RESOURCE: b"r", F_TYPE: b"T"}, id="missing-data"),
        pytest.param({}, id="no-fields"),
        pytest.param({b"garbage": b"\xff"}, id="foreign-fields"),
        pytest.param({**GOOD, F_RESOURCE: b"\xff\xfe"}, id="rid-not-utf8"),
        pytest.param(_with_data(b""), id="empty-data"),
        pytest.param(_with_data(b"\x07" + GOOD[F_DATA][1:]), id="unknown-format-byte"),
        pytest.param(_with_data(b"\x00"), id="format-byte-zero"),
        pytest.param(_with_data(GOOD[F_DATA][:-3]), id="truncated-msgpack"),
        pytest.param(_with_data(GOOD[F_DATA][:1]), id="format-byte-only"),
        pytest.param(_with_data(GOOD_Z[F_DATA][: len(GOOD_Z[F_DATA]) // 2]), id="truncated-zstd"),
        pytest.param(_with_data(b"\x02not a zstd frame at all"), id="bad-zstd"),
        pytest.param(_with_data(b"\x01\xc1"), id="msgpack-reserved-byte"),
        pytest.param(_with_data(_packed(v=1, id=ID16, ts=1, h={})), id="missing-payload-key"),
        pytest.param(_with_data(_packed(v=1, ts=1, h={}, p=None)), id="missing-id-key"),
        pytest.param(_with_data(_packed(v=2, id=ID16, ts=1, h={}, p=None)), id="wrong-version"),
        pytest.param(_with_data(_packed(v=1, id=b"short", ts=1, h={}, p=1)), id="short-event-id"),
        pytest.param(_with_data(_packed(v=1, id=ID16, ts="x", h={}, p=1)), id="ts-not-int"),
        pytest.param(_with_data(_packed(v=1, id=ID16, ts=1, h=[], p=1)), id="headers-not-map"),
        pytest.param(
            _with_data(bytes([FORMAT_MSGPACK]) + msgpack.packb([1, 2])), id="body-not-map"
        ),
        pytest.param(_with_data(bytes([FORMAT_MSGPACK]) + msgpack.packb({1: 2})), id="int-map-key"),
    ],
)
def test_decode_failures_raise_decode_error(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(DecodeError):
        decode_entry(fields)


def test_zstd_bomb_is_refused_by_max_bytes() -> None:
    body = msgpack.packb(
        {"v": 1, "id": ID16, "ts": 1, "h": {}, "p": "z" * 200_000}, use_bin_type=True
    )
    fields = _with_data(bytes([FORMAT_MSGPACK_ZSTD]) + zstandard.ZstdCompressor().compress(body))

    assert decode_entry(fields, max_bytes=1 << 20).payload == "z" * 200_000
    with pytest.raises(DecodeError):
        decode_entry(fields, max_bytes=10_000)


def test_zstd_frame_without_declared_size_is_bounded_too() -> None:
    body = msgpack.packb(
        {"v": 1, "id": ID16, "ts": 1, "h": {}, "p": "z" * 200_000}, use_bin_type=True
    )
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    fields = _with_data(bytes([FORMAT_MSGPACK_ZSTD]) + frame)

    assert decode_entry(fields, max_bytes=1 << 20).payload == "z" * 200_000
    with pytest.raises(DecodeError):
        decode_entry(fields, max_bytes=10_000)


def _json_like(rng: random.Random, depth: int = 0) -> object:
    """A random JSON-mode value (what `model_dump(mode="json")` yields): every length class of
    MessagePack's str, int, array and map headers is reached."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, -1, -32,
                           -33, -128, -129, -32768, -32769, -(2**31) - 1, -(2**63)])  # fmt: skip
    if kind == 3:
        return rng.uniform(-1e9, 1e9)
    if kind in (4, 5):
        n = rng.choice([0, 1, 31, 32, 255, 256, 65535, 65536])
        return rng.choice("aé€😀") * n
    if kind == 6:
        return [_json_like(rng, depth + 1) for _ in range(rng.choice([0, 1, 15, 16, 17]))]
    n = rng.choice([0, 1, 15, 16, 17])
    return {f"k{i}": _json_like(rng, depth + 1) for i in range(n)}


def test_the_envelope_encoder_writes_the_bytes_msgpack_writes() -> None:
    """The envelope is packed with msgspec (a fifth of the time); the wire format is
    msgpack-python's ``packb(..., use_bin_type=True)`` of the same map, byte for byte, for
    every kind of value a JSON-mode payload and the headers can hold."""
    rng = random.Random(7)
    for _ in range(300):
        env = Envelope(
            resource_id="r",
            event_type="T",
            event_id_bytes=new_event_id(),
            published_at_ms=rng.choice([0, 1_700_000_000_000, 2**40]),
            headers={f"h{i}": "v" * i for i in range(rng.choice([0, 1, 20]))},
            payload=_json_like(rng),
        )
        body = encode_entry(env, compress_threshold=1 << 30)[F_DATA][1:]
        expected = msgpack.packb(
            {"v": 1, "id": env.event_id_bytes, "ts": env.published_at_ms, "h": env.headers,
             "p": env.payload},
            use_bin_type=True,
        )  # fmt: skip
        assert body == expected


def test_event_ids_are_distinct_version_4_uuids_across_refills_and_threads() -> None:
    ids: list[bytes] = []

    def draw() -> None:
        ids.extend(new_event_id() for _ in range(1500))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == len(ids) == 6000
    assert all(uuid.UUID(bytes=i).version == 4 for i in ids)
    assert all(uuid.UUID(bytes=i).variant == uuid.RFC_4122 for i in ids)
