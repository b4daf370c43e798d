"""The stream entries add925e's encoder wrote (tests/fixtures/codec/entries.json, made by its
generate.py): formats 0x04 (with the fixture's zstd dictionary), 0x01 and 0x02, read by the
tests of the decoder and of the consumer on Redis (0x01 and 0x02 read, 0x04 refused as retired).

The fixture (a dict): ``dictionary_id`` (a decimal string), ``dictionary_hex``, and
``entries``: each with ``case`` (e.g. "0x04, headers"), ``envelope`` (the event's fields, its
event ID in hex) and ``fields`` (the entry's stream fields, values in hex)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eventbus.protocol.codec import Envelope
from eventbus.protocol.dictionaries import CACHE

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "codec" / "entries.json"


def load() -> dict[str, Any]:
    """The fixture, parsed afresh (a test may change its copy)."""
    fixture: dict[str, Any] = json.loads(FIXTURE.read_text())
    return fixture


def envelope(entry: dict[str, Any]) -> Envelope:
    """The `Envelope` of one of the fixture's ``entries``, as add925e's encoder was given it."""
    want = entry["envelope"]
    return Envelope(
        want["resource_id"],
        want["event_type"],
        bytes.fromhex(want["event_id_hex"]),
        want["published_at_ms"],
        want["headers"],
        want["payload"],
    )


def fields(entry: dict[str, Any]) -> dict[bytes, bytes]:
    """The stream fields add925e's encoder wrote for one of the fixture's ``entries``."""
    return {k.encode(): bytes.fromhex(v) for k, v in entry["fields"].items()}


def add_dictionary(fixture: dict[str, Any]) -> None:
    """Put the fixture's dictionary in this process's `CACHE` (as a consumer loads it)."""
    CACHE.add(int(fixture["dictionary_id"]), bytes.fromhex(fixture["dictionary_hex"]))
