"""Property-based fuzzing (hypothesis) of every decoder of bytes another client wrote: whatever
the bytes, only the decoder's documented error class comes out (`DecodeError`, `CorruptSegment`,
...), never ``RecursionError``, ``MemoryError``, ``TypeError``, ``ValueError``, ...

Each `Property` pairs a strategy (random bytes, well-formed values with hostile contents such as
nesting around the decoders' depth limits, mutations of valid encodings) with a check that
calls the decoder and lets only the documented error pass, at the interpreter's default
recursion limit. Here they run under the ``decoders`` profile: 150 examples each, derandomized
(the same examples every run, so the suite stays deterministic), no deadline, no example
database. ``stress/fuzz.py --minutes N`` runs the same `PROPERTIES` with random seeds for
longer; what it finds becomes a regression test in the tests of the decoder's module (e.g.
test_codec_decode_limits.py, test_segment_verification.py). docs/security.md, "Fuzzing the
decoders", lists what is covered.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import msgpack
import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis.configuration import set_hypothesis_home_dir
from pydantic import BaseModel

from eventbus.cli.rendering import json_text
from eventbus.errors import DecodeError, InvalidReply
from eventbus.protocol.budget import unpack_body
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    Envelope,
    decode_entry,
    encode_entry,
)
from eventbus.protocol.dead_letters import DeadLetter, parked_resources
from eventbus.protocol.dictionaries import (
    CACHE,
    BadDictionary,
    checked,
    dictionary_id,
    fingerprint,
    parse_id,
)
from eventbus.protocol.framing import decompressed_size
from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import (
    CORRELATION_ID,
    REPLY_KEY,
    REPLY_TO,
    REQUEST_ENTRY,
    answers,
    reply_stream,
)
from eventbus.protocol.verse.envelope import decode_verse
from eventbus.tier.archived import read_segment
from eventbus.tier.checkpoint import checkpoint_state
from eventbus.tier.errors import CorruptCheckpoint, CorruptGapRecord, CorruptSegment
from eventbus.tier.gaps import load_gap
from eventbus.tier.layout import SegmentRef, segment_key
from eventbus.tier.segment import SCHEMA
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import open_store
from eventbus.tier.typed import TypedPayloads

# hypothesis caches the constants of the source under its home directory (by default
# .hypothesis in the working directory, even without an example database): keep it out of the
# repository
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "eventbus-hypothesis")

DEFAULT_RECURSION_LIMIT = 1000
PROFILE = "decoders"
settings.register_profile(
    PROFILE,
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
IN_SUITE = settings.get_profile(PROFILE)

# -- values another client can write ----------------------------------------------------------


def nested(depth: int, leaf: Any = 0, as_map: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_map else [value]
    return value


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=4),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    ),
    max_leaves=12,
)
deep = st.builds(
    nested,
    st.one_of(st.sampled_from([1000, 1022, 960, 1100]), st.integers(900, 1100)),
    scalars,
    st.booleans(),
)
"""Nesting around the decoders' limits: msgspec and json stop at the interpreter's recursion
limit (1,000), MessagePack's unpacker at 1,024, its packer (``_pack``'s fallback) near there."""
hostile_values = st.one_of(values, deep)
deep_msgpack = st.builds(
    lambda n, as_map: (b"\x81\xa1k" if as_map else b"\x91") * n + b"\x90",
    st.one_of(st.sampled_from([1000, 4000]), st.integers(900, 5000)),
    st.booleans(),
)
"""MessagePack nested `n` deep, as no packer writes it (msgpack's stops near 1,000 levels)."""


def mostly(usual: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> Any:
    """`usual` three times in four, else `other`: most examples get past a decoder's first
    checks, so that its deeper steps are fuzzed too."""
    return st.sampled_from([usual, usual, usual, other]).flatmap(lambda chosen: chosen)


def rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in `one_in` draws (hypothesis leans to the first item: False)."""
    return bool(draw(st.sampled_from([False] * (one_in - 1) + [True])))


def packed(value: Any) -> bytes:
    """MessagePack of `value`, or of a shallower one when the packer refuses its depth."""
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except (ValueError, OverflowError):
        return bytes(msgpack.packb(None))


def mutated(data: bytes, draw: st.DrawFn) -> bytes:
    """`data` with a few bytes replaced, a slice cut out, or truncated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        if out:
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
    how = draw(st.sampled_from(["keep", "truncate", "cut"]))
    if how == "truncate" and out:
        del out[draw(st.integers(0, len(out) - 1)) :]
    elif how == "cut" and len(out) > 2:
        a = draw(st.integers(0, len(out) - 2))
        del out[a : a + draw(st.integers(1, 64))]
    return bytes(out)


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> bytes:
    return mutated(data, draw)


# -- a dictionary loaded for format 0x05 (and the retired 0x04, refused) ------------------------


def _trained_dictionary() -> tuple[int, bytes]:
    samples = [
        packed({"ts": i, "p": {"order": f"o-{i}", "n": i % 7, "note": "x" * (i % 13)}, "h": {}})
        for i in range(400)
    ]
    data = zstandard.train_dictionary(1024, samples, dict_id=1 << 20, level=3).as_bytes()
    dict_id = fingerprint(data)
    CACHE.add(dict_id, data)
    return dict_id, data


DICT_ID, _DICT_DATA = _trained_dictionary()
KEYS = Keys()


@st.composite
def entry_fields(draw: st.DrawFn, well_formed: bool = False) -> dict[bytes, bytes]:
    """An entry's field map as any client can XADD it: eventbus's three fields (or not), with
    a data field that is random, hostile MessagePack in any format, or a valid one mutated.
    `well_formed`: a valid envelope in each format whose payload alone is hostile."""
    if well_formed:
        body = {"v": 1, "id": bytes(16), "ts": 1, "h": {}}
        kind = draw(st.sampled_from(["0x01", "0x02", "0x05"]))
        # the payload as raw MessagePack: nesting past what msgpack's packer writes
        payload = draw(st.one_of(deep_msgpack, hostile_values.map(packed)))
        plain = bytes([0x85]) + packed(body)[1:] + packed("p") + payload
        if kind == "0x01":
            data = b"\x01" + plain
        elif kind == "0x02":
            data = b"\x02" + zstandard.ZstdCompressor().compress(plain)
        else:
            plain = bytes([0x83]) + packed({"ts": 1, "h": {}})[1:] + packed("p") + payload
            frame = zstandard.ZstdCompressor(dict_data=CACHE.get(DICT_ID)).compress(plain)
            data = b"\x05" + DICT_ID.to_bytes(8, "big") + bytes(16) + frame[4:]
        return {F_RESOURCE: b"r", F_TYPE: b"T", F_DATA: data}
    body = {
        "v": draw(mostly(st.just(1), values)),
        "id": draw(mostly(st.binary(min_size=16, max_size=16), values)),
        "ts": draw(mostly(st.integers(0, 1 << 45), values)),
        "h": draw(mostly(st.dictionaries(st.text(max_size=8), st.text(max_size=8)), values)),
        "p": draw(hostile_values),
    }
    if rarely(draw, 8):
        del body[draw(st.sampled_from(sorted(body)))]
    plain = packed(body)
    kind = draw(
        st.sampled_from(["0x01", "0x01", "0x02", "0x04", "0x05", "valid", "random", "format"])
    )
    if kind == "random":
        data = draw(st.binary(max_size=200))
    elif kind == "0x01":
        data = b"\x01" + plain
    elif kind == "0x02":
        data = b"\x02" + zstandard.ZstdCompressor().compress(plain)
    elif kind in ("0x04", "0x05"):
        dict_id = draw(st.sampled_from([DICT_ID, draw(st.integers(0, (1 << 64) - 1))]))
        comp = zstandard.ZstdCompressor(dict_data=CACHE.get(DICT_ID) if dict_id in CACHE else None)
        frame = comp.compress(plain)
        head = dict_id.to_bytes(8, "big")
        if kind == "0x05":
            data = b"\x05" + head + draw(st.binary(min_size=16, max_size=16)) + frame[4:]
        else:
            data = b"\x04" + head + frame
    elif kind == "valid":
        env = Envelope("r", "T", bytes(16), 1, {"a": "b"}, draw(values))
        data = encode_entry(
            env,
            compress_threshold=draw(st.sampled_from([1, 1 << 20])),
            dictionary=draw(st.sampled_from([None, DICT_ID])),
        )[F_DATA]
    else:
        data = bytes([draw(st.integers(0, 255))]) + draw(st.binary(max_size=40))
    if rarely(draw, 4):
        data = mutated(data, draw)
    fields: dict[bytes, bytes] = {F_DATA: data}
    fields[F_RESOURCE] = draw(mostly(st.just(b"r"), st.binary(max_size=8)))
    fields[F_TYPE] = draw(mostly(st.just(b"T"), st.binary(max_size=8)))
    if rarely(draw, 16):
        del fields[draw(st.sampled_from([F_DATA, F_RESOURCE, F_TYPE]))]
    return fields


@st.composite
def verse_fields(draw: st.DrawFn, well_formed: bool = False) -> dict[bytes, bytes]:
    """A Verse entry (``msg`` = zlib of MessagePack ``{i, c, h, r}``) with hostile contents;
    `well_formed`: a valid message whose content and header values alone are hostile."""
    if well_formed:
        headers = draw(st.dictionaries(st.text(max_size=8), st.one_of(deep, values), max_size=3))
        body = {"i": "abc", "c": draw(st.one_of(deep, values)), "h": headers, "r": None}
        return {b"msg": zlib.compress(packed(body))}
    body: dict[str, Any] = {
        "i": draw(mostly(st.just("abc"), st.one_of(st.text(max_size=30), values))),
        "c": draw(hostile_values),
        "h": draw(
            mostly(
                st.dictionaries(st.text(max_size=8), hostile_values, max_size=3),
                st.one_of(st.dictionaries(st.one_of(scalars, st.tuples()), values), values),
            )
        ),
        "r": draw(mostly(st.none(), st.one_of(st.text(max_size=20), values))),
    }
    if rarely(draw, 8):
        del body[draw(st.sampled_from(sorted(body)))]
    kind = draw(st.sampled_from(["message", "message", "random", "zlib-random", "other-value"]))
    if kind == "message":
        msg = zlib.compress(packed(body))
    elif kind == "random":
        msg = draw(st.binary(max_size=200))
    elif kind == "zlib-random":
        msg = zlib.compress(draw(st.binary(max_size=200)))
    else:
        msg = zlib.compress(packed(draw(hostile_values)))
    if rarely(draw, 4):
        msg = mutated(msg, draw)
    return {b"other": msg} if rarely(draw, 16) else {b"msg": msg}


# -- segments ----------------------------------------------------------------------------------

TOPIC, SHARD, FIRST, LAST = "orders", 0, EntryId(1000, 0), EntryId(1000, 9)
REF = SegmentRef(FIRST, LAST, segment_key(TOPIC, SHARD, FIRST, LAST), 0, TOPIC, SHARD)


def _valid_segment() -> bytes:
    entries = [
        (
            EntryId(1000, i),
            encode_entry(Envelope(f"r{i}", "T", uuid.uuid4().bytes, i, {"h": "v"}, {"n": i})),
        )
        for i in range(10)
    ]
    return encode_segment(TOPIC, SHARD, FIRST, LAST, entries)[0]


VALID_SEGMENT = _valid_segment()


@st.composite
def crafted_segment(draw: st.DrawFn) -> bytes:
    """A Parquet file of the segment schema and metadata, with hostile values in its columns
    (what a writer of the store, not the offloader, can put there)."""
    n = draw(st.integers(0, 4))
    text = st.one_of(st.none(), st.text(max_size=40))

    def col(strategy: st.SearchStrategy[Any]) -> list[Any]:
        return [draw(strategy) for _ in range(n)]

    if draw(st.booleans()):  # in order and in the range: the rows' values are read
        ids = [
            (1000, seq) for seq in sorted(draw(st.sets(st.integers(0, 9), min_size=n, max_size=n)))
        ]
    else:
        ids = col(st.tuples(st.integers(-5, 1005), st.integers(-2, 12)))

    columns = {
        "topic": pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array([TOPIC])),
        "shard": pa.array([SHARD] * n, pa.int32()),
        "entry_id": pa.array(col(st.text(max_size=12)), pa.string()),
        "entry_ms": pa.array([ms for ms, _ in ids], pa.int64()),
        "entry_seq": pa.array([seq for _, seq in ids], pa.int64()),
        "resource_id": pa.array(col(text), pa.string()),
        "event_type": pa.array(col(text), pa.string()),
        "event_time_ms": pa.array(col(st.one_of(st.none(), st.integers(-(1 << 62), 1 << 62)))),
        "event_id": pa.array(col(st.one_of(text, st.uuids().map(str))), pa.string()),
        "headers": pa.array(
            col(
                st.one_of(st.none(), st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5))))
            ),
            pa.map_(pa.string(), pa.string()),
        ),
        "data": pa.array(col(st.binary(max_size=30)), pa.binary()),
    }
    meta = {
        "eventbus.segment_version": draw(st.sampled_from(["1", "1", "2", "x"])),
        "eventbus.topic": TOPIC,
        "eventbus.shard": str(SHARD),
        "eventbus.first": draw(st.sampled_from([str(FIRST), str(FIRST), "1000", "nope", "-1-0"])),
        "eventbus.last": str(LAST),
        "eventbus.entries": draw(st.sampled_from([str(n), str(n), "x", str(n + 1)])),
        "eventbus.raw_bytes": draw(st.sampled_from(["0", "-1", "1e3"])),
    }
    if rarely(draw, 4):
        del meta[draw(st.sampled_from(sorted(meta)))]
    table = pa.Table.from_arrays(list(columns.values()), schema=SCHEMA.with_metadata(meta))
    sink = io.BytesIO()
    pq.write_table(table, sink, write_page_checksum=True)
    return sink.getvalue()


segment_bytes = st.one_of(st.binary(max_size=300), mutations(VALID_SEGMENT), crafted_segment())

_STORE_DIR = Path(tempfile.mkdtemp(prefix="eventbus-fuzz-"))
_STORE = open_store(str(_STORE_DIR))


# -- the properties ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Property:
    """`check(example)` must raise nothing but `allowed` for any `example` of `strategy`."""

    name: str
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], object]
    allowed: tuple[type[BaseException], ...]

    def run(self, example: Any) -> None:
        # at the interpreter's default limit, as a consumer runs: hypothesis raises it while a
        # test runs, which hid msgspec's and json's RecursionError at 1,000 levels
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(DEFAULT_RECURSION_LIMIT)
        try:
            self.check(example)
        except self.allowed:
            pass
        finally:
            sys.setrecursionlimit(limit)


def _parked(raw: dict[bytes, bytes]) -> None:
    parked = parked_resources(raw, "parked")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in parked.items())


def _decode_entry(fields: dict[bytes, bytes]) -> None:
    decompressed_size(fields.get(F_DATA, b""))
    env = decode_entry(fields, max_bytes=1 << 16)
    assert isinstance(env.headers, dict) and len(env.event_id_bytes) == 16


def _unpack_body(body: bytes) -> None:
    unpack_body(body, max_containers=64)


def _verse(fields: dict[bytes, bytes]) -> None:
    env = decode_verse(fields, entry_id="1-0", max_bytes=1 << 16)
    assert all(isinstance(v, str) for v in env.headers.values())


def _dictionary(data: bytes) -> None:
    checked(fingerprint(data), data)


def _dictionary_frame(data: bytes) -> None:
    dictionary_id(data)


def _dictionary_id_text(raw: bytes) -> None:
    parse_id(raw)


def _segment(data: bytes) -> None:
    decode_segment(data, REF.key, expect=REF.span)


def _segment_entries(data: bytes) -> None:
    obstore.put(_STORE, REF.key, data)
    for entry in read_segment(_STORE, REF).entries:
        entry.fields()


def _reply_headers(headers: dict[str, str]) -> None:
    reply_stream(KEYS, headers)


def _reply_entry(example: tuple[int, str, dict[bytes, bytes]]) -> None:
    """What a caller does with an entry of its reply stream: decode it, then check that it
    names the caller's own request entry (`answers`)."""
    shard, entry_id, fields = example
    why = answers(decode_entry(fields), shard, entry_id)
    assert why is None or isinstance(why, str)


def _gap_record(data: bytes) -> None:
    load_gap(data, "gaps/x.json")


def _checkpoint(fields: tuple[bytes | None, ...]) -> None:
    checkpoint_state("ckpt", *fields)


def _dead_letter(fields: dict[bytes, bytes]) -> None:
    DeadLetter.parse(b"1-0", fields).original()


def _rendered(fields: dict[bytes, bytes]) -> None:
    """What ``eventbus tail`` and ``eventbus dlq show`` print of an entry: its JSON line."""
    out: dict[str, Any] = {"shard": 0, "entry_id": "1-0"}
    try:
        env = decode_entry(fields)
        out |= {"headers": env.headers, "payload": env.payload, "event_id": str(env.event_id)}
    except DecodeError as exc:
        out["error"] = str(exc)
    json.loads(json_text(out))


class _Row(BaseModel):
    n: int = 0
    note: str = ""


_TYPED = TypedPayloads({"T": _Row})


def _typed(fields: dict[bytes, bytes]) -> None:
    """The typed columns of segments and of the Spark source (`eventbus.spark.decode`)."""
    data = fields.get(F_DATA, b"\x01")
    struct, errors = _TYPED.columns([data, data], ["T", "U"])
    assert len(struct) == 2 and errors[1] is None


fields_maps = st.dictionaries(
    st.sampled_from([b"rid", b"type", b"data", b"mac", b"x", b"orig_data", b"shard"]),
    st.binary(max_size=40),
)
header_maps = st.dictionaries(
    st.sampled_from([REPLY_TO, REPLY_KEY, CORRELATION_ID, REQUEST_ENTRY, "x"]),
    st.one_of(
        st.text(max_size=80),
        st.just(KEYS.reply("", "")[:-1]).flatmap(lambda p: st.text(max_size=40).map(p.__add__)),
        st.just(KEYS.reply("orders", uuid.uuid4().hex)),
        st.binary(min_size=32, max_size=32).map(bytes.hex),
    ),
)
opt_bytes = st.one_of(st.none(), st.binary(max_size=30), st.text(max_size=30).map(str.encode))

PROPERTIES: dict[str, Property] = {
    p.name: p
    for p in [
        Property("envelope", entry_fields(), _decode_entry, (DecodeError,)),
        Property("envelope-payload", entry_fields(True), _decode_entry, (DecodeError,)),
        Property(
            "msgpack-body",
            st.one_of(st.binary(max_size=300), hostile_values.map(packed)),
            _unpack_body,
            (DecodeError,),
        ),
        Property("verse-entry", verse_fields(), _verse, (DecodeError,)),
        Property("verse-values", verse_fields(True), _verse, (DecodeError,)),
        Property(
            "dictionary",
            st.one_of(
                st.binary(max_size=300),
                mutations(CACHE.get(DICT_ID).as_bytes()),
            ),
            _dictionary,
            (BadDictionary,),
        ),
        Property("dictionary-frame", st.binary(max_size=20), _dictionary_frame, (DecodeError,)),
        Property("dictionary-id", st.binary(max_size=24), _dictionary_id_text, (ValueError,)),
        Property("segment", segment_bytes, _segment, (CorruptSegment,)),
        Property("segment-entries", segment_bytes, _segment_entries, (CorruptSegment,)),
        Property("reply-headers", header_maps, _reply_headers, (InvalidReply,)),
        Property(
            "reply-entry",
            st.tuples(st.integers(-1, 5), st.text(max_size=20), entry_fields()),
            _reply_entry,
            (DecodeError,),
        ),
        Property(
            "gap-record",
            st.one_of(
                st.binary(max_size=200),
                st.dictionaries(st.text(max_size=12), values, max_size=8).map(
                    lambda d: json.dumps(d, default=str).encode()
                ),
                deep.map(lambda v: json.dumps(nested(900)).encode()),
            ),
            _gap_record,
            (CorruptGapRecord,),
        ),
        Property(
            "checkpoint",
            st.tuples(opt_bytes, opt_bytes, opt_bytes, opt_bytes),
            _checkpoint,
            (CorruptCheckpoint,),
        ),
        Property("dead-letter", fields_maps, _dead_letter, ()),
        Property(
            "parked-hash",
            st.dictionaries(st.binary(max_size=40), st.binary(max_size=40), max_size=8),
            _parked,
            (),
        ),
        Property("cli-rendering", st.one_of(entry_fields(), entry_fields(True)), _rendered, ()),
        Property("typed-columns", st.one_of(entry_fields(), entry_fields(True)), _typed, ()),
    ]
}
"""Every fuzzed decoder, by name (``stress/fuzz.py --only NAME``)."""


@pytest.mark.parametrize("name", sorted(PROPERTIES))
def test_only_the_documented_error_comes_out(name: str) -> None:
    prop = PROPERTIES[name]
    # the process-wide cache: other tests clear it (dictionaries deleted, another deployment)
    if DICT_ID not in CACHE:
        CACHE.add(DICT_ID, _DICT_DATA)

    @IN_SUITE
    @given(prop.strategy)
    def holds(example: Any) -> None:
        prop.run(example)

    holds()
