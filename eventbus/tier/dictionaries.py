"""The durable tier's copies of zstd dictionaries (`eventbus.protocol.dictionaries`).

Segments keep each entry's ``data`` field as it was in Redis, so an entry compressed with a
dictionary needs that dictionary to be read back, long after Redis may have lost it (or from a
Spark executor that never talks to Redis). The offloader copies every dictionary a segment's
entries use to ``<topic>/_dictionaries/<id>.zdict`` (`layout.dictionary_key`) before it puts the
segment; readers of the archive register the store as a fallback of the process's cache.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from redis.exceptions import ResponseError

from eventbus.errors import DecodeError
from eventbus.protocol.dictionaries import CACHE, BadDictionary, dictionary_id
from eventbus.protocol.keys import Keys
from eventbus.tier.layout import dictionary_key
from eventbus.tier.store import Store, get_bytes_sync, put_create

log = logging.getLogger("eventbus.tier")
_archived: set[tuple[int, str, int]] = set()  # (id(store), topic, dictionary ID) copied here
_readers: set[tuple[int, str]] = set()  # (their loaders hold the store: its id stays its own)
_watched: set[int] = set()  # ids of the live stores `_archived` has records of


def _store_id(store: Store) -> int:
    """`id(store)`, whose `_archived` records go with the store: a store made later at the same
    address (another URL) must not look as if it had the dictionaries already."""
    sid = id(store)
    if sid not in _watched:
        _watched.add(sid)
        weakref.finalize(store, _forget_store, sid)
    return sid


def _forget_store(sid: int) -> None:
    _watched.discard(sid)
    _archived.difference_update([key for key in _archived if key[0] == sid])


async def archive_dictionaries(
    redis: Any,
    keys: Keys,
    store: Store,
    topic: str,
    rows: Iterable[tuple[Any, Mapping[bytes, bytes]]],
) -> None:
    """Copy the dictionaries `rows` (entry ID, fields) use to `store`, each once per process
    (create-only: an existing copy is left as it is). One missing in Redis, refused by it (an
    error reply: WRONGTYPE, NOPERM) or not valid (bytes that do not match the ID: see
    `eventbus.protocol.dictionaries.checked`) is skipped with a WARNING and never copied: its
    entries are archived as they are and read back as undecodable. Raises connection errors."""
    needed: set[int] = set()
    sid = _store_id(store)
    for _, fields in rows:
        try:
            dict_id = dictionary_id(fields.get(b"data", b""))
        except DecodeError:
            continue
        if dict_id is not None and (sid, topic, dict_id) not in _archived:
            needed.add(dict_id)
    if not needed:
        return
    key = keys.dictionaries(topic)
    for dict_id in sorted(needed):
        try:
            data = await redis.hget(key, str(dict_id))
            if data is None:  # (deleted by hand, or a failover lost it): said, never skipped
                log.warning(
                    "topic %s: dictionary %s not archived: missing from %s; the entries that "
                    "use it are archived as they are and read back as undecodable",
                    topic,
                    dict_id,
                    key,
                )
                continue
            CACHE.add(dict_id, data)
        except (ResponseError, BadDictionary) as exc:
            log.warning(
                "topic %s: dictionary %s not archived from %s: %s", topic, dict_id, key, exc
            )
            continue
        await put_create(store, dictionary_key(topic, dict_id), data)
        _archived.add((sid, topic, dict_id))


def read_from(store: Store, topic: str) -> None:
    """Let this process's dictionary cache load `topic`'s dictionaries from `store` on a miss
    (replay, Spark). Blocking reads: for threads and sync code, not an event loop."""
    if (id(store), topic) in _readers:
        return
    _readers.add((id(store), topic))

    def load(dict_id: int) -> bytes | None:
        try:
            return get_bytes_sync(store, dictionary_key(topic, dict_id))
        except FileNotFoundError:
            return None

    CACHE.loaders.append(load)
