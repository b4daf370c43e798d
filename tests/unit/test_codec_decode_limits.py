"""MessagePack amplification. Decoding is bounded by structure as well as by bytes, so a small entry
cannot make a consumer (or the offloader, ``tail``, ``dlq show``, replay) allocate gigabytes.

The bomb below is a ~6 KB entry whose body decompresses to 60 MB of nested empty arrays (60 M
lists). Today's main decodes it into ~4 GB of Python lists (checked by hand under ``ulimit -v
3000000``: MemoryError after 31 s at 2.8 GB RSS); these tests only assert the new behaviour and
bound their own memory with tracemalloc.
"""

from __future__ import annotations

import tracemalloc

import msgpack
import msgspec
import pytest
import zstandard

from eventbus.errors import DecodeError
from eventbus.protocol.budget import CONTAINER_BYTES, MIN_CONTAINERS, unpack_body
from eventbus.protocol.codec import THREAD_DECODE_BYTES, Envelope, decode_entry, encode_entry

HEAD = msgpack.packb({"v": 1, "id": b"\0" * 16, "ts": 0, "h": {}}, use_bin_type=True)


def _with_payload(payload_bytes: bytes) -> bytes:
    """An envelope body whose ``p`` value is the given raw MessagePack bytes."""
    return bytes([0x85]) + HEAD[1:] + msgpack.packb("p") + payload_bytes


def _entry(data: bytes) -> dict[bytes, bytes]:
    return {b"rid": b"r", b"type": b"T", b"data": data}


def nested_array_bomb(outer: int = 1000, inner: int = 60_000) -> bytes:
    """``data`` field: zstd frame (declaring its size) of `outer` arrays of `inner` empty arrays,
    compressed chunk by chunk so that the test never holds the decompressed body itself."""
    head = _with_payload(b"\xdc" + outer.to_bytes(2, "big"))
    chunk = b"\xdd" + inner.to_bytes(4, "big") + b"\x90" * inner
    c = zstandard.ZstdCompressor(level=3).compressobj(size=len(head) + outer * len(chunk))
    parts = [c.compress(head)] + [c.compress(chunk) for _ in range(outer)] + [c.flush()]
    return b"\x02" + b"".join(parts)


def test_nested_empty_array_bomb_is_a_decode_error_with_bounded_memory() -> None:
    data = nested_array_bomb()
    assert len(data) < 16_384  # a small entry, far under any max_payload_bytes
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="decompression bomb"):
            decode_entry(_entry(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 60 MB body + at most ~1 M small lists; today's main allocates ~4 GB here
    # (that it ends is shown by its ending; a wall-clock bound failed under CPU load: 64 s)
    assert peak < 400 << 20, peak


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4 G elements
        b"\xdf\xff\xff\xff\xff",  # map32 header claiming 4 G pairs
        b"\xdb\xff\xff\xff\xff",  # str32 header claiming 4 GB
        b"\xc6\xff\xff\xff\xff",  # bin32 header claiming 4 GB
        b"\xc9\xff\xff\xff\xff\x01",  # ext32 header claiming 4 GB
    ],
)
def test_huge_headers_in_a_tiny_body_are_refused(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_entry(_entry(b"\x01" + _with_payload(payload)))


def test_dense_containers_over_the_budget_are_refused_under_the_byte_cap() -> None:
    # 100 arrays of 2,000 empty maps in 200 KB: one container per byte, over one per
    # CONTAINER_BYTES, although each header is plausible
    inner = b"\xdc" + (2000).to_bytes(2, "big") + b"\x80" * 2000
    body = _with_payload(b"\xdc" + (100).to_bytes(2, "big") + inner * 100)
    data = b"\x02" + zstandard.ZstdCompressor().compress(body)
    with pytest.raises(DecodeError, match="arrays/maps"):
        decode_entry(_entry(data))


def test_max_containers_caps_the_budget_whatever_the_size() -> None:
    body = _with_payload(msgpack.packb([[i, "abcdefghijklmnop"] for i in range(5000)]))
    assert unpack_body(body, max_containers=10_000)["p"][4999] == [4999, "abcdefghijklmnop"]
    with pytest.raises(DecodeError, match="arrays/maps"):
        unpack_body(body, max_containers=100)


def test_long_arrays_of_scalars_are_not_containers() -> None:
    env = Envelope("r", "T", b"\1" * 16, 0, {}, {"ids": list(range(300_000))})
    assert decode_entry(encode_entry(env)).payload["ids"][-1] == 299_999


def test_realistic_dense_payloads_still_decode() -> None:
    # a list of 100,000 small records: a container every ~20 bytes, compressible 50x or more
    payload = {"rows": [{"id": i, "ok": True, "tag": "x"} for i in range(100_000)]}
    env = Envelope("r", "T", b"\1" * 16, 0, {"k": "v"}, payload)
    fields = encode_entry(env)
    assert fields[b"data"][0] == 0x02
    assert decode_entry(fields).payload == payload


def test_small_bodies_are_never_refused_for_structure() -> None:
    # MIN_CONTAINERS empty maps: as dense as MessagePack allows, but under 4 KiB of budget
    n = MIN_CONTAINERS - 10
    env = Envelope("r", "T", b"\1" * 16, 0, {}, [{} for _ in range(n)])
    assert len(decode_entry(encode_entry(env)).payload) == n
    assert CONTAINER_BYTES >= 1 and THREAD_DECODE_BYTES > 0


@pytest.mark.parametrize("depth", [1_000, 3_000])
def test_a_payload_nested_past_the_decoders_depth_is_a_decode_error(depth: int) -> None:
    """A 1-3 KB entry of nested arrays: msgspec's typed decode (the 0x01 fast path) stops at
    the interpreter's C recursion limit with ``RecursionError``, which escaped `decode_entry`
    and ended the consumer (and the offloader) reading it, at every restart. That limit is
    1,000 on 3.11 and higher from 3.12 (gh-91079; about 1,500 on 3.12, 10,000 on 3.13): where
    this depth decodes, the entry is an ordinary one."""
    nested = b"\x91" * depth + b"\x90"
    data = bytes([0x01]) + _with_payload(nested)
    assert len(data) <= MIN_CONTAINERS  # the fast path
    fields = {b"rid": b"r", b"type": b"T", b"data": data}
    try:
        msgspec.msgpack.decode(nested)
    except RecursionError:  # this interpreter's limit is below `depth`
        with pytest.raises(DecodeError, match="RecursionError"):
            decode_entry(fields)
    else:
        value = decode_entry(fields).payload
        for _ in range(depth):
            (value,) = value
        assert value == []
