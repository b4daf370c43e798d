"""Entry formats with a zstd dictionary: ``0x05`` as written now (its bytes, and what it saves
against ``0x04``), and entries of an older encoder (tests/fixtures/codec/entries.json, written by
add925e's, see its generate.py): its ``0x01`` and ``0x02`` entries decode as written, its
``0x04`` ones (a dictionary format no release wrote) are refused as retired."""

from __future__ import annotations

import random
import statistics
from typing import Any

import msgpack
import pytest
import zstandard
from cases import add925e_entries

from eventbus.errors import DecodeError
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    Envelope,
    decode_entry,
    dictionary_body,
    encode_entry,
)
from eventbus.protocol.dictionaries import (
    CACHE,
    FORMAT_DICT_COMPACT,
    UnknownDictionary,
    dictionary_id,
    fingerprint,
)
from eventbus.protocol.framing import decompressed_size

OLD = add925e_entries.load()


def _flight(rng: random.Random, i: int, headers: dict[str, str] | None = None) -> Envelope:
    """A flights-like event with a random event ID, as `envelope_of` makes them."""
    plane = f"N{rng.randrange(10000, 99999)}"
    payload = {
        "position": i,
        "seq": rng.randrange(1, 500),
        "plane": plane,
        "year": 2013,
        "month": rng.randrange(1, 13),
        "day": rng.randrange(1, 29),
        "time_hour": f"2013-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T05:00:00Z",
        "dep_delay": rng.choice([None, rng.randrange(-10, 300)]),
        "carrier": rng.choice(["UA", "AA", "B6", "DL"]),
        "flight": rng.randrange(1, 6000),
        "origin": rng.choice(["EWR", "JFK", "LGA"]),
        "dest": rng.choice(["ATL", "ORD", "LAX", "BOS", "MIA"]),
        "distance": rng.randrange(100, 3000),
    }
    ts = 1_764_115_200_000 + rng.randrange(10**7)
    return Envelope(plane, "flights.Flight", rng.randbytes(16), ts, headers or {}, payload)


def _plain_body(env: Envelope) -> bytes:
    """The whole envelope map (format 0x01's body), which format 0x04 compressed."""
    return encode_entry(env, compress_threshold=1 << 30)[F_DATA][1:]


@pytest.fixture(scope="module")
def trained() -> tuple[int, list[Envelope], list[Envelope]]:
    """(a dictionary ID in `CACHE`, trained as ``train-dict`` does on `dictionary_body`, the
    training events, other events of the same kind)."""
    rng = random.Random(18)
    events = [_flight(rng, i) for i in range(1500)]
    data = zstandard.train_dictionary(2048, [dictionary_body(e) for e in events[:1000]], level=3)
    dict_id = fingerprint(data.as_bytes())
    CACHE.add(dict_id, data.as_bytes())
    return dict_id, events[:1000], events[1000:]


_RETIRED = [e for e in OLD["entries"] if e["case"].startswith("0x04")]
_CURRENT = [e for e in OLD["entries"] if not e["case"].startswith("0x04")]


@pytest.mark.parametrize("entry", _CURRENT, ids=lambda e: e["case"])
def test_entries_of_an_older_encoder_decode_as_written(entry: dict[str, Any]) -> None:
    add925e_entries.add_dictionary(OLD)
    fields = add925e_entries.fields(entry)

    env = decode_entry(fields)

    assert env == add925e_entries.envelope(entry)
    assert decompressed_size(fields[F_DATA]) > 0


@pytest.mark.parametrize("entry", _RETIRED, ids=lambda e: e["case"])
def test_entries_of_the_retired_dictionary_format_are_refused(entry: dict[str, Any]) -> None:
    add925e_entries.add_dictionary(OLD)
    fields = add925e_entries.fields(entry)
    assert fields[F_DATA][0] == 0x04

    with pytest.raises(DecodeError, match="envelope format 0x04 is retired"):
        decode_entry(fields)


@pytest.mark.parametrize("headers", [{}, {"traceparent": "00-ab-cd-01"}])
def test_dictionary_entry_layout(trained: Any, headers: dict[str, str]) -> None:
    """0x05: format byte, dictionary ID (8 bytes, big endian), event ID (16 bytes), then a zstd
    frame without magic number of the map ts, p (and h only when not empty)."""
    dict_id = trained[0]
    env = _flight(random.Random(7), 7, headers)

    data = encode_entry(env, dictionary=dict_id)[F_DATA]

    assert data[0] == FORMAT_DICT_COMPACT == 0x05
    assert data[1:9] == dict_id.to_bytes(8, "big") and dictionary_id(data) == dict_id
    assert data[9:25] == env.event_id_bytes
    assert data[25:29] != b"\x28\xb5\x2f\xfd"  # no magic number
    z = zstandard.ZstdDecompressor(
        dict_data=CACHE.get(dict_id), format=zstandard.FORMAT_ZSTD1_MAGICLESS
    )
    body = z.decompress(data[25:])
    want: dict[str, Any] = {"ts": env.published_at_ms, "p": env.payload}
    if headers:
        want["h"] = headers
    assert msgpack.unpackb(body) == want
    assert decompressed_size(data) == len(body) == len(dictionary_body(env))
    assert decode_entry(encode_entry(env, dictionary=dict_id)) == env


def test_dictionary_entries_are_at_least_6_bytes_shorter_than_format_0x04(trained: Any) -> None:
    """The same events, each format with a dictionary trained for it as ``train-dict`` trains
    it (0x04: on whole envelope maps, at the same level, without dictionary ID in the frame)."""
    dict_id, train, events = trained
    old_dict = zstandard.train_dictionary(2048, [_plain_body(e) for e in train], level=3)
    old = zstandard.ZstdCompressor(level=3, dict_data=old_dict, write_dict_id=False)
    old_sizes = [1 + 8 + len(old.compress(_plain_body(e))) for e in events]

    new_sizes = [len(encode_entry(e, dictionary=dict_id)[F_DATA]) for e in events]

    assert statistics.mean(new_sizes) <= statistics.mean(old_sizes) - 6, (
        statistics.mean(old_sizes),
        statistics.mean(new_sizes),
    )
    for e in events[:50]:
        assert decode_entry(encode_entry(e, dictionary=dict_id)) == e


def _fields(data: bytes) -> dict[bytes, bytes]:
    return {F_RESOURCE: b"r", F_TYPE: b"T", F_DATA: data}


def test_dictionary_entry_failures_are_decode_errors(trained: Any) -> None:
    dict_id, _, events = trained
    good = encode_entry(events[0], dictionary=dict_id)[F_DATA]
    head = good[:25]
    body_without_ts = zstandard.ZstdCompressor(
        dict_data=CACHE.get(dict_id),
        compression_params=zstandard.ZstdCompressionParameters.from_level(
            3, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_dict_id=False
        ),
    ).compress(msgpack.packb({"p": 1}))

    with pytest.raises(DecodeError, match="truncated"):
        decode_entry(_fields(good[:25]))
    with pytest.raises(DecodeError, match="truncated"):
        decode_entry(_fields(good[:5]))
    with pytest.raises(DecodeError, match="corrupt envelope"):
        decode_entry(_fields(head + good[25:-3]))
    with pytest.raises(DecodeError, match="corrupt envelope"):
        decode_entry(_fields(head + body_without_ts))
    with pytest.raises(DecodeError, match=r"decompresses to \d+ bytes, over 100"):
        decode_entry(_fields(good), max_bytes=100)
    with pytest.raises(UnknownDictionary):
        decode_entry(_fields(good[:1] + (12345).to_bytes(8, "big") + good[9:]))
    assert decompressed_size(head + b"\xff") == -1


def test_an_event_id_that_is_not_16_bytes_is_refused_with_a_dictionary(trained: Any) -> None:
    dict_id, _, events = trained
    env = events[0]
    short = Envelope(env.resource_id, env.event_type, b"\x01" * 15, env.published_at_ms)
    with pytest.raises(ValueError, match="15 bytes, not 16"):
        encode_entry(short, dictionary=dict_id)
    with pytest.raises(DecodeError):  # the other formats carry it, and readers refuse it
        decode_entry(encode_entry(short))
