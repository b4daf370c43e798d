"""Object keys of the durable tier, built and parsed in this one module.

Inside a store (whose own prefix comes from its URL, e.g. ``s3://bucket/prefix``)::

    <topic>/shard=<shard>/<first>-<last>.parquet        a segment: entries first..last
                                                        (inclusive)
    <topic>/shard=<shard>/_gaps/<after>-<before>.json   a gap record: entries after..before
                                                        (exclusive) were lost before they could
                                                        be archived
    <topic>/_dictionaries/<id>.zdict                    a zstd dictionary entries of the topic
                                                        use (`eventbus.protocol.dictionaries`)

``<first>``, ``<last>``, ``<after>`` and ``<before>`` are entry IDs with both parts zero-padded to
20 digits (`EntryId.padded`), so a plain text sort of a shard's keys is entry-ID order, and a
listing can start after a given segment (``offset``). ``<shard>`` is the decimal shard index.

The shard folders are Hive-style (``shard=3``) and everything that is not a segment sits in a
folder whose name starts with ``_``, which Spark, pyarrow and DuckDB's ``*.parquet`` globs skip:
``spark.read.parquet("<store>/<topic>")`` or ``read_parquet('<topic>/*/*.parquet')`` read the
segments and nothing else, with a ``shard`` partition column equal to the segments' own.

Stores written before this layout have ``<topic>/<shard>/`` folders (gap records in
``<topic>/<shard>/gaps/``). They stay readable: every listing here covers both folders
(`shard_prefixes`, `gap_prefixes`), and new objects go to the Hive-style ones only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import check_name

SEGMENT_SUFFIX = ".parquet"
SHARD_FOLDER = "shard="
"""A shard folder's name is this and the decimal shard index (Hive-style partition folder)."""
GAP_FOLDER = "_gaps"
LEGACY_GAP_FOLDER = "gaps"
"""The gap folder of the earlier layout (``<topic>/<shard>/gaps/``), still read."""
_PADDED = r"(\d{20})-(\d{20})"
_SEGMENT = re.compile(rf"{_PADDED}-{_PADDED}\.parquet")
_GAP = re.compile(rf"{_PADDED}-{_PADDED}\.json")


def shard_prefix(topic: str, shard: int) -> str:
    """``<topic>/shard=<shard>/``: the folder of one shard's segments (new objects)."""
    check_name("topic", topic)
    return f"{topic}/{SHARD_FOLDER}{shard}/"


def legacy_shard_prefix(topic: str, shard: int) -> str:
    """``<topic>/<shard>/``: the folder of one shard's segments in the earlier layout."""
    check_name("topic", topic)
    return f"{topic}/{shard}/"


def shard_prefixes(topic: str, shard: int) -> tuple[str, str]:
    """Both folders one shard's segments can be in: (`shard_prefix`, `legacy_shard_prefix`)."""
    return shard_prefix(topic, shard), legacy_shard_prefix(topic, shard)


def shard_of_folder(name: str) -> int | None:
    """The shard index a folder name stands for (``shard=3`` or, earlier layout, ``3``), or
    None when it is no shard folder."""
    index = name.removeprefix(SHARD_FOLDER)
    return int(index) if index.isdigit() and index.isascii() else None


def segment_key(topic: str, shard: int, first: EntryId, last: EntryId) -> str:
    """Key of the segment holding entries `first`..`last` (inclusive) of a shard."""
    return segment_key_in(shard_prefix(topic, shard), first, last)


def segment_key_in(prefix: str, first: EntryId, last: EntryId) -> str:
    """Key of the segment of entries `first`..`last` in shard folder `prefix` (either layout's,
    `shard_prefixes`)."""
    return f"{prefix}{first.padded}-{last.padded}{SEGMENT_SUFFIX}"


def dictionary_key(topic: str, dict_id: int) -> str:
    """Key of the copy of zstd dictionary `dict_id` that entries of `topic` use."""
    check_name("topic", topic)
    return f"{topic}/_dictionaries/{dict_id}.zdict"


def gap_prefix(topic: str, shard: int) -> str:
    """``<topic>/shard=<shard>/_gaps/``: the folder of one shard's gap records (new ones)."""
    return f"{shard_prefix(topic, shard)}{GAP_FOLDER}/"


def gap_prefixes(topic: str, shard: int) -> tuple[str, str]:
    """Both folders one shard's gap records can be in: `gap_prefix` and the earlier layout's
    ``<topic>/<shard>/gaps/``."""
    return gap_prefix(topic, shard), f"{legacy_shard_prefix(topic, shard)}{LEGACY_GAP_FOLDER}/"


def gap_key(topic: str, shard: int, after: EntryId, before: EntryId) -> str:
    """Key of the record of entries lost strictly between `after` and `before`."""
    return f"{gap_prefix(topic, shard)}{after.padded}-{before.padded}.json"


@dataclass(frozen=True, slots=True, order=True)
class SegmentRef:
    """A segment object found by listing: its range (ordering key first), key and size (bytes)."""

    first: EntryId
    last: EntryId
    key: str
    size: int = 0
    topic: str = ""
    shard: int = 0

    @property
    def span(self) -> tuple[str, int, EntryId, EntryId]:
        """(topic, shard, first, last): what the key names, which the segment's metadata must
        match (`eventbus.tier.segment_read.decode_segment`'s `expect`)."""
        return self.topic, self.shard, self.first, self.last


def parse_segment_key(key: str, size: int = 0) -> SegmentRef | None:
    """The `SegmentRef` of a segment key (with or without a store prefix; either layout), or
    None if `key` is not a segment (a gap record, a temporary file, anything else)."""
    parts = key.rsplit("/", 3)
    if len(parts) < 3:
        return None
    topic, folder, name = parts[-3], parts[-2], parts[-1]
    m = _SEGMENT.fullmatch(name)
    shard = shard_of_folder(folder)
    if m is None or shard is None:
        return None
    a, b, c, d = (int(g) for g in m.groups())
    return SegmentRef(EntryId(a, b), EntryId(c, d), key, size, topic, shard)


def parse_gap_key(key: str) -> tuple[EntryId, EntryId] | None:
    """(after, before) of a gap record key, or None if `key` is not one."""
    m = _GAP.fullmatch(key.rsplit("/", 1)[-1])
    if m is None:
        return None
    a, b, c, d = (int(g) for g in m.groups())
    return EntryId(a, b), EntryId(c, d)
