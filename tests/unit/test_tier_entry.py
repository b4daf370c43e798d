"""`ArchivedEntry` read from its batch's columns (`eventbus.tier.entry`): every field has the
value and type the row holds, an entry equals, hashes, prints and pickles as one built from the
same values, it cannot be changed, and an ``event_id`` that is not a UUID fails the read, not
a later field access. Segments are written with the offloader's encoder into a memory store
(`test_tier_replay.put`)."""

from __future__ import annotations

import pickle
import uuid

import obstore
import pyarrow as pa
import pytest
from test_tier_replay import TOPIC, put

from eventbus.protocol.ids import EntryId
from eventbus.tier.archived import read_segment
from eventbus.tier.entry import FIELDS, ArchivedEntry, all_have_event_ids, rows_entries
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.segment import decode_segment
from eventbus.tier.store import list_segments_sync, open_store


def entries() -> list[ArchivedEntry]:
    store = open_store("memory://")
    put(store, 2, [EntryId(10, i) for i in range(5)])
    (ref,) = list_segments_sync(store, TOPIC, 2)
    return read_segment(store, ref).entries


def rebuilt(e: ArchivedEntry) -> ArchivedEntry:
    return ArchivedEntry(**{name: getattr(e, name) for name in FIELDS})


def test_fields_are_the_rows_values_with_their_types() -> None:
    got = entries()
    assert [e.entry_id for e in got] == [EntryId(10, i) for i in range(5)]
    for e in got:
        assert (e.topic, e.shard) == (TOPIC, 2) and e.segment.endswith(".parquet")
        assert type(e.entry_id) is EntryId and isinstance(e.event_id, uuid.UUID)
        assert e.resource_id in {"r0", "r1", "r2"} and e.event_type == "Tick"
        assert isinstance(e.published_at_ms, int) and e.headers == {}
        assert e.envelope().payload == {"seq": e.entry_id.seq}
        assert e.fields() == {b"data": e.data, b"rid": e.resource_id.encode(), b"type": b"Tick"}
    assert all_have_event_ids(got)


def test_equal_hashed_printed_and_pickled_as_one_built_from_its_values() -> None:
    got = entries()
    for e in got:
        same = rebuilt(e)
        assert same == e and e == same and same is not e
        assert repr(same) == repr(e) and repr(e).startswith(f"ArchivedEntry(topic={TOPIC!r}, ")
        assert pickle.loads(pickle.dumps(e)) == e
        assert e.values() == tuple(getattr(e, name) for name in FIELDS)
    assert got[0] != got[1] and got[0] != "not an entry"
    with pytest.raises(TypeError):  # a dict among its values (headers), as before
        hash(got[0])
    no_headers = ArchivedEntry(TOPIC, 0, EntryId(1, 0), None, None, None, None, None, b"x", "")
    assert hash(no_headers) == hash(rebuilt(no_headers)) and not all_have_event_ids([no_headers])
    match no_headers:
        case ArchivedEntry(topic, shard, entry_id):
            assert (topic, shard, entry_id) == (TOPIC, 0, EntryId(1, 0))


def test_an_entry_cannot_be_changed() -> None:
    e = entries()[0]
    with pytest.raises(AttributeError):
        e.data = b"other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del e.topic  # type: ignore[misc]


def test_an_event_id_that_is_no_uuid_fails_the_read_not_a_later_access() -> None:
    store = open_store("memory://")
    put(store, 0, [EntryId(5, 0), EntryId(5, 1)])
    (ref,) = list_segments_sync(store, TOPIC, 0)
    data = bytes(obstore.get(store, ref.key).bytes())
    table, _ = decode_segment(data, ref.key, expect=ref.span)
    bad = table.set_column(
        table.schema.get_field_index("event_id"),
        "event_id",
        pa.array([str(uuid.uuid4()), "not-a-uuid"]),
    )
    with pytest.raises(CorruptSegment, match="event_id"):
        rows_entries(bad, TOPIC, 0, ref.key)
    braces = bad.set_column(
        bad.schema.get_field_index("event_id"),
        "event_id",
        pa.array([str(uuid.uuid4()), "{" + str(uuid.uuid4()) + "}"]),
    )
    assert isinstance(rows_entries(braces, TOPIC, 0, ref.key)[1].event_id, uuid.UUID)
