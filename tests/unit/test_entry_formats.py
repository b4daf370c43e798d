"""The format of entries with a zstd dictionary that publishers write (`Settings.entry_format`,
`eventbus.protocol.entry_formats`): 0x04 for a rolling upgrade is what add925e's encoder wrote,
byte for byte (tests/fixtures/codec/entries.json), entries without a dictionary are the same
with both, and an unknown format is a `ConfigError`. Redis: tests/integration/test_dictionaries.py.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import zstandard
from cases import add925e_entries

from eventbus import Settings
from eventbus.config.settings import ENTRY_FORMATS
from eventbus.errors import ConfigError
from eventbus.protocol import compression
from eventbus.protocol.codec import (
    F_DATA,
    Envelope,
    decode_entry,
    decompressed_size,
    dictionary_body,
    encode_entry,
    new_event_id,
)
from eventbus.protocol.dictionaries import CACHE, UnknownDictionary, dictionary_id, fingerprint
from eventbus.protocol.entry_formats import ENTRY_ENCODERS, encode_entry_0x04, entry_encoder
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.publisher import Publisher

OLD = add925e_entries.load()
HOW = {  # how add925e's generate.py called its encoder for each case
    "0x04, no headers": {"dictionary": int(OLD["dictionary_id"])},
    "0x04, headers": {"dictionary": int(OLD["dictionary_id"])},
    "0x01": {},
    "0x02": {"compress_threshold": 0},
}


@pytest.fixture(autouse=True)
def _old_dictionary() -> None:
    add925e_entries.add_dictionary(OLD)


@pytest.mark.parametrize("entry", OLD["entries"], ids=lambda e: e["case"])
def test_format_4_writes_add925e_s_bytes(entry: dict[str, Any]) -> None:
    """What add925e's encoder wrote for the same event and dictionary, every field byte for
    byte: so every reader of add925e's release reads it as it read its own entries."""
    compression.clear()  # a compressor made afresh, as in a new publisher process
    env = add925e_entries.envelope(entry)

    fields = entry_encoder(4)(env, **HOW[entry["case"]])

    assert {k.decode(): v.hex() for k, v in fields.items()} == entry["fields"]
    assert decode_entry(fields) == env


@pytest.mark.parametrize("headers", [{}, {"traceparent": "00-ab-cd-01"}])
def test_format_4_layout_and_round_trip(headers: dict[str, str]) -> None:
    """0x04: format byte, dictionary ID (8 bytes, big endian), then a whole zstd frame (magic
    number first, no dictionary ID) of the full map, whatever its size."""
    dict_id = int(OLD["dictionary_id"])
    env = Envelope("N1", "flights.Flight", new_event_id(), 1_764_115_200_000, headers, {"a": 1})

    data = encode_entry_0x04(env, dictionary=dict_id)[F_DATA]

    assert data[0] == 0x04 and dictionary_id(data) == dict_id
    assert data[9:13] == b"\x28\xb5\x2f\xfd"
    params = zstandard.get_frame_parameters(data[9:])
    assert (params.dict_id, params.has_checksum) == (0, False)
    plain = encode_entry(env, compress_threshold=1 << 30)[F_DATA]
    assert params.content_size == decompressed_size(data) == len(plain) - 1
    assert decode_entry(encode_entry_0x04(env, dictionary=dict_id)) == env


def test_entries_without_a_dictionary_are_the_same_with_both_formats() -> None:
    rng = random.Random(4)
    for i in range(200):
        payload = {"i": i, "pad": "x" * rng.randrange(0, 3000)}
        env = Envelope(f"r{i}", "T", new_event_id(), time.time_ns() // 10**6, {}, payload)
        threshold = rng.choice([0, 1024, 1 << 30])
        assert entry_encoder(4)(env, compress_threshold=threshold) == entry_encoder(5)(
            env, compress_threshold=threshold
        )


def test_format_4_with_a_dictionary_not_in_the_cache_raises() -> None:
    env = Envelope("r", "T", new_event_id(), 1, {}, {})
    with pytest.raises(UnknownDictionary):
        encode_entry_0x04(env, dictionary=12345)


def test_the_encoders_by_format() -> None:
    assert entry_encoder(5) is encode_entry
    assert entry_encoder(4) is encode_entry_0x04
    assert set(ENTRY_ENCODERS) == set(ENTRY_FORMATS)  # every value the settings accept


@pytest.mark.parametrize("bad", [3, 6, "4", None, True])
def test_an_unknown_format_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError) as info:
        entry_encoder(bad)
    assert str(info.value) == (
        f"unknown entry_format {bad!r} (EVENTBUS_ENTRY_FORMAT): publishers write format "
        "5 (0x05) or 4 (0x04) for entries with a zstd dictionary (docs/operations.md)"
    )


def _publisher(settings: Settings) -> Publisher:
    return Publisher(None, settings, Keys(), registry=None)  # type: ignore[arg-type]


def test_a_publisher_writes_the_format_of_its_settings() -> None:
    """A topic with a current dictionary: format 0x05 by default, 0x04 with entry_format=4;
    both decode to the same event."""
    rng = random.Random(5)
    bodies = [
        dictionary_body(Envelope("r", "T", rng.randbytes(16), i, {}, {"n": i, "s": "ab" * (i % 9)}))
        for i in range(300)
    ]
    trained = zstandard.train_dictionary(1024, bodies, level=3).as_bytes()
    dict_id = fingerprint(trained)
    CACHE.add(dict_id, trained)
    topic = TopicConfig("t", 4, 10_000)
    env = Envelope("r1", "T", new_event_id(), 1_764_115_200_000, {}, {"n": 1, "s": "ab"})
    written = {}
    for fmt in (None, 4, 5):
        p = _publisher(Settings() if fmt is None else Settings(entry_format=fmt))
        p.dictionaries._current["t"] = (time.monotonic(), dict_id)  # as its refresh found it
        _, fields = p.prepare_envelope(topic, env)
        written[fmt] = fields[F_DATA]
        assert decode_entry(fields) == env
    assert (written[None][0], written[4][0], written[5][0]) == (0x05, 0x04, 0x05)
    assert dictionary_id(written[4]) == dictionary_id(written[5]) == dict_id


def test_a_publisher_with_an_unknown_format_is_not_made() -> None:
    """Settings made without validation (here ``model_construct``) are checked when the
    publisher picks its encoder."""
    with pytest.raises(ConfigError, match="unknown entry_format 3"):
        _publisher(Settings.model_construct(entry_format=3))
