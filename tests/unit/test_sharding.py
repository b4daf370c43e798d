"""Resource ID -> shard: the documented xxh64 function, pinned by test vectors."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import xxhash

from eventbus.errors import ConfigError
from eventbus.protocol.sharding import MAX_SHARDS, check_shards, shard_of

# xxh64(utf8(id), seed 0), computed once with the `xxhash` package. The first two are the
# reference values of the xxHash specification, so they also pin the seed and the encoding.
VECTORS = [
    ("", 0xEF46DB3751D8E999),
    ("abc", 0x44BC2CF5AD770999),
    ("a", 0xD24EC4F1A98C6E5B),
    ("N14228", 0x1DB17D3D2CC55032),
    ("order-42", 0xB5623EC0A2FA4FCE),
    ("Ünïcødé", 0xDFB1149BD2C01D0D),
    ("日本", 0x80C2E40B8486AFAB),
]


@pytest.mark.parametrize(("resource_id", "digest"), VECTORS)
@pytest.mark.parametrize("shards", [1, 7, 16, 64, 1024])
def test_shard_is_xxh64_mod_shards(resource_id: str, digest: int, shards: int) -> None:
    assert shard_of(resource_id, shards) == digest % shards


def test_pinned_shards_of_16() -> None:
    got = {rid: shard_of(rid, 16) for rid, _ in VECTORS}
    assert got == {
        "": 9,
        "abc": 9,
        "a": 11,
        "N14228": 2,
        "order-42": 14,
        "Ünïcødé": 13,
        "日本": 11,
    }


def test_distribution_over_16_shards_is_roughly_even() -> None:
    counts = collections.Counter(shard_of(f"resource-{i}", 16) for i in range(10_000))

    assert sorted(counts) == list(range(16))
    # expected 625 per shard, binomial sd ~ 24: +-15 % is over 3.5 sd
    assert all(530 <= c <= 720 for c in counts.values()), counts


def test_stable_across_calls_and_in_range() -> None:
    for i in range(1000):
        rid = f"r{i}"
        s = shard_of(rid, 13)
        assert 0 <= s < 13
        assert shard_of(rid, 13) == s


@pytest.mark.parametrize("bad", [0, -1, MAX_SHARDS + 1, 1.0, "16", True, None])
def test_invalid_shard_counts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError):
        check_shards(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("good", [1, 16, MAX_SHARDS])
def test_valid_shard_counts(good: int) -> None:
    assert check_shards(good) == good


def _documented_vectors() -> list[tuple[str, str, str, int, int]]:
    """Rows of the test-vector table in docs/protocol.md: (id, utf8 hex, xxh64 hex, %16, %64)."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    if not doc.is_file():
        pytest.skip("docs/protocol.md is not part of this tree")
    row = re.compile(
        r"^\| `([^`]+)`[^|]*\| `([0-9a-f]+)` \| `([0-9a-f]{16})` \| (\d+) \| (\d+) \|$"
    )
    rows = [m.groups() for line in doc.read_text().splitlines() if (m := row.match(line))]
    return [(rid, utf8, digest, int(s16), int(s64)) for rid, utf8, digest, s16, s64 in rows]


def test_documented_vectors_hold() -> None:
    rows = _documented_vectors()
    assert len(rows) >= 10
    for _, utf8, digest, s16, s64 in rows:
        resource_id = bytes.fromhex(utf8).decode("utf-8")  # the doc's NFC/NFD rows differ here
        assert xxhash.xxh64_intdigest(bytes.fromhex(utf8)) == int(digest, 16), resource_id
        assert shard_of(resource_id, 16) == s16, resource_id
        assert shard_of(resource_id, 64) == s64, resource_id
