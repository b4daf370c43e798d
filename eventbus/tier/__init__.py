"""The durable tier: shard streams archived as Parquet segments in an object store.

Needs the ``tier`` extra (obstore, pyarrow). docs/tier.md describes the format and protocol.
Names are imported on first use, so ``eventbus`` commands that do not touch the tier do not pay
for importing pyarrow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CatchUp": "catchup",
    "CatchUpOutpaced": "errors",
    "CatchUpStats": "catchup",
    "catch_up": "eventbus.consumer.catchup",  # typed: through the consumer's handling path
    "catch_up_group": "catchup",
    "CorruptSegment": "errors",
    "LockUnavailable": "errors",
    "StoreError": "errors",
    "TierError": "errors",
    "EntryId": "eventbus.protocol.ids",
    "parse_id": "eventbus.protocol.ids",
    "OffloadStats": "offloader",
    "Offloader": "offloader",
    "offload_until_caught_up": "offloader",
    "ArchivedEntry": "replay",
    "ReplayFilter": "replay",
    "ReplayedEvent": "replay",
    "iter_events": "replay",
    "iter_shard": "replay",
    "iter_topic": "replay",
    "plan": "replay",
    "OFFLOADER_GROUP": "settings",
    "TierSettings": "settings",
    "open_store": "store",
    "ArchiveReport": "verify",
    "verify_archive": "verify",
}

__all__ = [
    "OFFLOADER_GROUP",
    "ArchiveReport",
    "ArchivedEntry",
    "CatchUp",
    "CatchUpOutpaced",
    "CatchUpStats",
    "CorruptSegment",
    "EntryId",
    "LockUnavailable",
    "OffloadStats",
    "Offloader",
    "ReplayFilter",
    "ReplayedEvent",
    "StoreError",
    "TierError",
    "TierSettings",
    "catch_up",
    "catch_up_group",
    "iter_events",
    "iter_shard",
    "iter_topic",
    "offload_until_caught_up",
    "open_store",
    "parse_id",
    "plan",
    "verify_archive",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eventbus.tier' has no attribute {name!r}")
    # a dotted name is a module outside the tier: entry IDs are protocol, and the typed catch-up
    # runs the consumer's handling path (imported lazily: the consumer imports the tier)
    path = module if "." in module else f"eventbus.tier.{module}"
    return getattr(importlib.import_module(path), name)


if TYPE_CHECKING:
    from eventbus.consumer.catchup import catch_up
    from eventbus.protocol.ids import EntryId, parse_id
    from eventbus.tier.catchup import CatchUp, CatchUpStats, catch_up_group
    from eventbus.tier.errors import (
        CatchUpOutpaced,
        CorruptSegment,
        LockUnavailable,
        StoreError,
        TierError,
    )
    from eventbus.tier.offloader import Offloader, OffloadStats, offload_until_caught_up
    from eventbus.tier.replay import (
        ArchivedEntry,
        ReplayedEvent,
        ReplayFilter,
        iter_events,
        iter_shard,
        iter_topic,
        plan,
    )
    from eventbus.tier.settings import OFFLOADER_GROUP, TierSettings
    from eventbus.tier.store import open_store
    from eventbus.tier.verify import ArchiveReport, verify_archive
