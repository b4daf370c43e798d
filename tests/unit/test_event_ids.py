"""Event IDs: version-4 UUIDs (RFC 9562), unique across refills of the per-thread buffer, and
not shared with a forked child."""

from __future__ import annotations

import os
import uuid

from eventbus.protocol.event_ids import _IDS_AT_ONCE, new_event_id


def test_ids_are_version_4_uuids_and_unique_across_refills() -> None:
    ids = [new_event_id() for _ in range(3 * _IDS_AT_ONCE + 7)]
    assert len(set(ids)) == len(ids)
    for raw in ids:
        assert len(raw) == 16
        u = uuid.UUID(bytes=raw)
        assert u.version == 4
        assert u.variant == uuid.RFC_4122


def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    new_event_id()  # the buffer holds IDs drawn ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ID, to the parent
        try:
            os.write(write, new_event_id())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    parent = new_event_id()
    assert len(child) == 16
    assert child != parent
