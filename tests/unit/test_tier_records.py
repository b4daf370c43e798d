"""Gap records and checkpoint fields read back strictly, and an object store that cannot work
refused when opened."""

from __future__ import annotations

import json
from dataclasses import asdict

import obstore
import pytest

from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import Keys
from eventbus.testing import memory_redis
from eventbus.tier.checkpoint import Checkpoints, Intent, ShardCheckpoint, checkpoint_state
from eventbus.tier.completeness import recorded_lost
from eventbus.tier.errors import CorruptCheckpoint, CorruptGapRecord, StoreError
from eventbus.tier.gaps import Gap, gap_json, gap_records, load_gap
from eventbus.tier.layout import gap_key
from eventbus.tier.store import open_store

GAP = Gap("orders", 0, "5-0", "9-0", 3, 1_700_000_000_000, "offloader", "trimmed")


def test_gap_records_parse_in_key_order() -> None:
    store = open_store("memory://")
    later = Gap("orders", 0, "20-0", "30-0", None, 1, "offloader", "deleted")
    for gap in (later, GAP):
        obstore.put(store, gap.key, json.dumps(asdict(gap)).encode())
    obstore.put(store, "orders/0/gaps/README.txt", b"not a record")  # ignored: not a gap key
    records = gap_records(store, "orders", 0)
    assert [r["key"] for r in records] == [GAP.key, later.key]
    assert records[0] == {**asdict(GAP), "key": GAP.key}
    assert recorded_lost(store, "orders", 0) is None  # one count unknown


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "record"),
        (b"[1, 2]", "record"),
        (json.dumps({**asdict(GAP), "lost_entries": "three"}).encode(), "lost_entries"),
        (json.dumps({**asdict(GAP), "after": "five"}).encode(), "not a stream entry ID"),
        (json.dumps({k: v for k, v in asdict(GAP).items() if k != "shard"}).encode(), "shard"),
    ],
)
def test_a_damaged_gap_record_is_an_error_naming_it(body: bytes, reason: str) -> None:
    """It used to be a bare JSONDecodeError (or a KeyError later, or counted as a record)."""
    store = open_store("memory://")
    key = gap_key("orders", 0, EntryId(5, 0), EntryId(9, 0))
    obstore.put(store, key, body)
    with pytest.raises(CorruptGapRecord, match=reason) as caught:
        gap_records(store, "orders", 0)
    assert caught.value.key == key
    with pytest.raises(CorruptGapRecord):
        recorded_lost(store, "orders", 0)


def test_a_gap_kept_in_redis_reads_back_as_the_same_record() -> None:
    """The JSON an offloader keeps as ``<shard>:gap`` until it stores the record."""
    assert load_gap(gap_json(GAP), "cps 0:gap") == GAP
    assert load_gap(gap_json(GAP).encode(), "cps 0:gap") == GAP
    with pytest.raises(CorruptGapRecord, match="cps 0:gap") as caught:
        load_gap('{"topic": "orders"}', "cps 0:gap")
    assert caught.value.key == "cps 0:gap"


def test_plain_http_endpoint_from_env_needs_allow_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """obstore refuses every request to an http:// AWS_ENDPOINT_URL without AWS_ALLOW_HTTP; the
    offloader then retried for ever. Opening the store says so now."""
    monkeypatch.delenv("AWS_ENDPOINT", raising=False)
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:secret@127.0.0.1:9000")
    with pytest.raises(StoreError, match="AWS_ALLOW_HTTP") as caught:
        open_store("s3://bucket/prefix")
    assert "secret" not in str(caught.value)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    open_store("s3://bucket/prefix")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    open_store("s3://bucket/prefix")
    # an explicit endpoint argument decides on its own (allow_http follows its scheme)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    open_store("s3://bucket/prefix", endpoint="http://127.0.0.1:9000")


def test_source_options_repr_hides_the_redis_password() -> None:
    pytest.importorskip("pyspark")
    from eventbus.spark.options import SourceOptions

    opts = SourceOptions.parse(
        {"store": "memory://", "topic": "orders", "redis_url": "redis://:hunter2@h:6379/0"}
    )
    assert "hunter2" not in repr(opts) and "redis_url=" in repr(opts)
    assert opts.redis_url == "redis://:hunter2@h:6379/0"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"0": b"\xff-0"}, "UnicodeDecodeError"),
        ({"0": b"5-0", "0:pending": b"1-0 2-0"}, "ValueError"),
        ({"0": b"5-0", "0:pending": b"1-0 x 3"}, "not a stream entry ID"),
        ({"0:count": b"many"}, "ValueError"),
        ({"0:count": b"-5"}, "count -5 is negative"),
        ({"0": b"5-0", "0:pending": b"6-0 9-0 -3"}, "no range of entries"),
        ({"0": b"5-0", "0:pending": b"9-0 6-0 3"}, "no range of entries"),
        ({"0:gap": b"\xff"}, "UnicodeDecodeError"),
    ],
)
async def test_checkpoint_fields_not_written_by_the_offloader_are_an_error_naming_them(
    fields: dict[str, bytes], reason: str
) -> None:
    """Raised ``ValueError``, ``UnicodeDecodeError`` or `ConfigError` from the offloader's and
    the catch-up's read of the checkpoint hash (found by tests/unit/test_decoders_fuzz.py)."""
    redis = memory_redis()
    checkpoints = Checkpoints(redis, Keys(), "orders")
    await redis.hset(checkpoints.key, mapping=fields)
    for read in (checkpoints.read, checkpoints.read_all):
        with pytest.raises(CorruptCheckpoint, match=rf"{checkpoints.key} shard 0: .*{reason}"):
            await read(0)
    await redis.aclose()


def test_checkpoint_fields_the_offloader_writes_read_back() -> None:
    state = checkpoint_state("k", b"5-0", b"6-0 9-3 4", b"12", b"{}")
    assert state == ShardCheckpoint(
        EntryId(5, 0), Intent(EntryId(6, 0), EntryId(9, 3), 4), 12, "{}"
    )
    assert checkpoint_state("k", None, None, None, None) == ShardCheckpoint(None, None, 0, None)
