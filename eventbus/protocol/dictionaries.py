"""Per-topic zstd dictionaries: trained from a topic's entries, stored versioned in Redis, and
cached in each process by ID.

Small entries compress poorly on their own (a flights event: 257 bytes of MessagePack, 250
with plain zstd) and very well against a dictionary trained on their siblings (about 80 bytes):
the field names and common values live in the dictionary, not in every entry.

* **Storage** (`Keys.dictionaries`, beside the topic registry): a hash per topic, field
  ``<id>`` -> the dictionary's bytes, field ``current`` -> the ID new entries use. IDs come from
  one counter (`Keys.dictionary_seq`), so an ID names one dictionary across all topics and a
  process caches them by ID alone. Training a new dictionary adds a version and moves
  ``current``; older versions stay, so entries written with them stay readable.
* **Entries** say which dictionary they need: format byte ``0x03``, the ID as a LEB128 varint,
  then a zstd frame without its own dictionary ID (docs/protocol.md).
* **Reading**: `eventbus.protocol.codec` decodes with the dictionaries in this process's cache
  (`CACHE`). Async readers with Redis (consumers, ``eventbus tail``, the offloader) call
  `Dictionaries.ensure` before decoding; readers of the archive (replay, Spark) load them from
  the store, where the offloader copies each one it meets (`eventbus.tier.dictionaries`). An
  entry whose dictionary is nowhere to be found fails to decode with `UnknownDictionary` (a
  `DecodeError`: the consumer dead-letters it as ``undecodable``, with the ID and where it was
  looked for).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zstandard
from redis.exceptions import ResponseError

from eventbus.errors import ConfigError, DecodeError
from eventbus.protocol.keys import Keys

log = logging.getLogger("eventbus")

FORMAT_MSGPACK_ZSTD_DICT = 0x03
CURRENT = b"current"
DEFAULT_SIZE = 16 * 1024
"""Default dictionary size in bytes: enough for the field names and common values of a topic."""
REFRESH_S = 30.0
"""Publishers look for a newer current dictionary of a topic at most this often (seconds)."""
_MISSING_RETRY_S = 5.0


class UnknownDictionary(DecodeError):
    """An entry needs a zstd dictionary this process does not have and could not load."""

    def __init__(self, dict_id: int, where: str = "") -> None:
        self.dict_id = dict_id
        super().__init__(
            f"entry is compressed with zstd dictionary {dict_id}, which is not loaded"
            + (f" ({where})" if where else "")
            + ": it was deleted, or the entry comes from another deployment"
        )


class DictionaryCache:
    """Process-wide: dictionary ID -> `zstandard.ZstdCompressionDict` (thread-safe reads)."""

    def __init__(self) -> None:
        self._dicts: dict[int, zstandard.ZstdCompressionDict] = {}
        self._missing: dict[int, tuple[float, str]] = {}  # id -> (when, where it was looked for)
        self._lock = threading.Lock()
        self.loaders: list[Callable[[int], bytes | None]] = []
        """Synchronous fallbacks tried on a miss (an archive's store); not for event loops."""

    def add(self, dict_id: int, data: bytes) -> zstandard.ZstdCompressionDict:
        with self._lock:
            d = self._dicts.get(dict_id)
            if d is None or d.as_bytes() != data:  # new, or an ID reused by a flushed Redis
                d = self._dicts[dict_id] = zstandard.ZstdCompressionDict(data)
            self._missing.pop(dict_id, None)
            return d

    def __contains__(self, dict_id: object) -> bool:
        return dict_id in self._dicts

    def get(self, dict_id: int) -> zstandard.ZstdCompressionDict:
        """The dictionary `dict_id`, from the cache or a loader. Raises `UnknownDictionary`."""
        d = self._dicts.get(dict_id)
        if d is not None:
            return d
        for load in self.loaders:
            data = load(dict_id)
            if data is not None:
                return self.add(dict_id, data)
        _, where = self._missing.get(dict_id, (0.0, ""))
        raise UnknownDictionary(dict_id, where)

    def missing(self, dict_id: int, where: str) -> None:
        self._missing[dict_id] = (time.monotonic(), where)

    def recently_missing(self, dict_id: int) -> bool:
        seen = self._missing.get(dict_id)
        return seen is not None and time.monotonic() - seen[0] < _MISSING_RETRY_S


CACHE = DictionaryCache()


def dictionary_id(data: bytes) -> int | None:
    """The dictionary ID an entry's ``data`` field needs (None for other formats). Raises
    `DecodeError` for a truncated varint."""
    if not data or data[0] != FORMAT_MSGPACK_ZSTD_DICT:
        return None
    return read_varint(data, 1)[0]


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint at `pos`: (value, position after it)."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 35:
            raise DecodeError("truncated dictionary ID")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Dictionaries:
    """A topic's dictionaries in Redis: train, read the current one, load by ID into `CACHE`."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._current: dict[str, tuple[float, int | None]] = {}  # topic -> (checked at, id)

    async def train(self, topic: str, samples: Iterable[bytes], size: int = DEFAULT_SIZE) -> int:
        """Train a dictionary of `size` bytes from `samples` (MessagePack bodies), store it as the
        topic's new current version, and return its ID. Raises `ConfigError` when zstd cannot
        train from the samples (too few, or too alike)."""
        bodies: list[Any] = list(samples)
        # IDs start at a random point of [2**15, 2**20) per deployment: zstd reserves 1..32767,
        # and the process-wide cache is keyed by ID, so another deployment (or this one after a
        # FLUSHALL) must not reuse an ID it may hold for another dictionary. 3 bytes per entry.
        seq = self.keys.dictionary_seq()
        await self.redis.set(seq, random.randrange(1 << 15, 1 << 20), nx=True)
        dict_id = int(await self.redis.incr(seq))
        try:
            trained = zstandard.train_dictionary(size, bodies, dict_id=dict_id, level=3)
        except zstandard.ZstdError as exc:
            raise ConfigError(
                f"topic {topic!r}: cannot train a dictionary from {len(bodies)} samples ({exc})"
            ) from None
        key = self.keys.dictionaries(topic)
        await self.redis.hset(key, mapping={str(dict_id): trained.as_bytes(), CURRENT: dict_id})
        CACHE.add(dict_id, trained.as_bytes())
        return dict_id

    async def versions(self, topic: str) -> tuple[int | None, dict[int, int]]:
        """(the current ID, {ID: size in bytes} of every stored version) of `topic`."""
        raw = await self.redis.hgetall(self.keys.dictionaries(topic))
        current = raw.pop(CURRENT, None)
        return (int(current) if current else None), {int(k): len(v) for k, v in raw.items()}

    async def current(self, topic: str) -> int | None:
        """The ID new entries of `topic` use (None: no dictionary), loaded into `CACHE`; asks
        Redis at most every `REFRESH_S` seconds."""
        now = time.monotonic()
        checked = self._current.get(topic)
        if checked is not None and now - checked[0] < REFRESH_S:
            return checked[1]
        previous = None if checked is None else checked[1]
        self._current[topic] = (now, previous)  # concurrent callers do not ask again meanwhile
        try:
            raw = await self.redis.hget(self.keys.dictionaries(topic), CURRENT)
        except ResponseError as exc:  # e.g. NOPERM: an ACL written before dictionaries existed
            log.warning("topic %s: cannot read its zstd dictionary (%s); not using one", topic, exc)
            return previous
        dict_id = int(raw) if raw else None
        if dict_id is not None and dict_id not in CACHE:
            await self._load(topic, dict_id)
        self._current[topic] = (now, dict_id if dict_id is not None and dict_id in CACHE else None)
        return self._current[topic][1]

    def due(self, topic: str) -> bool:
        """Whether `current(topic)` would ask Redis (never asked, or `REFRESH_S` passed)."""
        checked = self._current.get(topic)
        return checked is None or time.monotonic() - checked[0] >= REFRESH_S

    def cached_current(self, topic: str) -> int | None:
        checked = self._current.get(topic)
        return None if checked is None else checked[1]

    async def ensure(self, topic: str, data: bytes) -> None:
        """Load the dictionary an entry's ``data`` needs into `CACHE`, if any and not there.
        Never raises for a missing one: decoding then raises `UnknownDictionary`."""
        try:
            dict_id = dictionary_id(data)
        except DecodeError:
            return
        if dict_id is None or dict_id in CACHE or CACHE.recently_missing(dict_id):
            return
        await self._load(topic, dict_id)

    async def _load(self, topic: str, dict_id: int) -> None:
        key = self.keys.dictionaries(topic)
        data = await self.redis.hget(key, str(dict_id))
        if data is None:
            CACHE.missing(dict_id, f"not in Redis hash {key}")
        else:
            CACHE.add(dict_id, data)
