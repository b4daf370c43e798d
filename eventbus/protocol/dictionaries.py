"""Per-topic zstd dictionaries: trained from a topic's entries, stored in Redis under an ID that
is a fingerprint of their bytes, and cached in each process by ID.

Small entries compress poorly on their own (a flights event: 257 bytes of MessagePack, 250
with plain zstd) and very well against a dictionary trained on their siblings (about 80 bytes):
the field names and common values live in the dictionary, not in every entry.

* **IDs are fingerprints**: a dictionary's ID is the first 8 bytes of the SHA-256 of its bytes
  (`fingerprint`, an unsigned 64-bit integer). Every reader checks it when it loads a dictionary
  (`DictionaryCache.add`), so a dictionary overwritten in Redis or in the archive is a
  `DecodeError`, never a silently different payload, and IDs are the same in every deployment
  (a process that talked to another Redis, or to this one before a ``FLUSHALL``, cannot hold
  another dictionary under the same ID).
* **Storage** (`Keys.dictionaries`, beside the topic registry): a hash per topic, field
  ``<id>`` (decimal) -> the dictionary's bytes, written once (``HSETNX``: never overwritten),
  field ``current`` -> the ID new entries use. Training a new dictionary adds a version and moves
  ``current``; older versions stay, so entries written with them stay readable.
* **Entries** say which dictionary they need: format byte ``0x05``, the ID as 8 bytes (big
  endian), the event ID, then a zstd frame without magic number nor dictionary ID
  (docs/protocol.md, `eventbus.protocol.codec`). Formats ``0x03`` (a counter ID not bound to
  the bytes) and ``0x04`` (the ID, then a whole zstd frame of the full envelope map), written
  by unreleased versions only, are refused.
* **Validity**: a dictionary is loaded only if it is a zstd dictionary (magic number, entropy
  tables) that zstd accepts for compressing and decompressing: a planted garbage dictionary is a
  `BadDictionary` (a `DecodeError`) for readers, and publishers keep the dictionary they had.
* **Reading**: `eventbus.protocol.codec` decodes with the dictionaries in this process's cache
  (`CACHE`). Async readers with Redis (consumers, ``eventbus tail``, the offloader) call
  `Dictionaries.ensure` before decoding; readers of the archive (replay, Spark) load them from
  the store, where the offloader copies each one it meets (`eventbus.tier.dictionaries`). An
  entry whose dictionary is nowhere to be found fails to decode with `UnknownDictionary`, one
  whose dictionary does not match its ID or is not valid with `BadDictionary` (both
  `DecodeError`: the consumer dead-letters such an entry as ``undecodable``, with the ID and
  where it was looked for).
"""

from __future__ import annotations

import copy
import hashlib
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

FORMAT_DICT_COMPACT = 0x05
"""The format byte of entries compressed with a dictionary, as written now (codec.py)."""
RETIRED_DICT_FORMATS = (0x03, 0x04)
"""Format bytes of dictionary entries of unreleased versions (0x03: an ID not bound to the
dictionary's bytes; 0x04: the ID, then a whole zstd frame of the full envelope map): refused."""
DICT_FORMATS = (FORMAT_DICT_COMPACT,)
"""Format bytes of entries that name a dictionary (its ID in the 8 bytes after the format byte)."""
ID_BYTES = 8
CURRENT = b"current"
DEFAULT_SIZE = 16 * 1024
"""Default dictionary size in bytes: enough for the field names and common values of a topic."""
REFRESH_S = 30.0
"""Publishers look for a newer current dictionary of a topic at most this often (seconds)."""
LEVEL = 3
"""zstd level entries are compressed at (a dictionary is checked to work at it)."""
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


class BadDictionary(DecodeError):
    """The bytes found for a zstd dictionary do not match its ID (they were replaced) or are
    not a valid zstd dictionary: entries that need it cannot be decoded."""

    def __init__(self, dict_id: int, why: str) -> None:
        self.dict_id, self.why = dict_id, why
        super().__init__(f"zstd dictionary {dict_id} refused: {why}")


def fingerprint(data: bytes) -> int:
    """The ID of the dictionary whose bytes are `data`: the first 8 bytes of their SHA-256, as
    an unsigned big-endian integer (docs/protocol.md)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:ID_BYTES], "big")


def checked(dict_id: int, data: bytes) -> zstandard.ZstdCompressionDict:
    """`data` as a zstd dictionary, checked: its fingerprint is `dict_id`, and zstd accepts it
    for compressing (at `LEVEL`) and decompressing. Raises `BadDictionary`."""
    if not isinstance(data, bytes) or fingerprint(data) != dict_id:
        raise BadDictionary(dict_id, "its bytes do not match its ID (they were replaced)")
    try:
        d = zstandard.ZstdCompressionDict(data, dict_type=zstandard.DICT_TYPE_FULLDICT)
        d.precompute_compress(level=LEVEL)
        zstandard.ZstdDecompressor(dict_data=d)
    except zstandard.ZstdError as exc:
        raise BadDictionary(dict_id, f"not a valid zstd dictionary ({exc})") from None
    return d


class DictionaryCache:
    """Process-wide: dictionary ID -> `zstandard.ZstdCompressionDict` (thread-safe reads).
    Only dictionaries that passed `checked` get in."""

    def __init__(self) -> None:
        self._dicts: dict[int, zstandard.ZstdCompressionDict] = {}
        # id -> (when, why it could not be loaded: the error decoding then raises)
        self._missing: dict[int, tuple[float, DecodeError]] = {}
        self._lock = threading.Lock()
        self.loaders: list[Callable[[int], bytes | None]] = []
        """Synchronous fallbacks tried on a miss (an archive's store); not for event loops."""

    def add(self, dict_id: int, data: bytes) -> zstandard.ZstdCompressionDict:
        """Check `data` against `dict_id` (`checked`) and cache it. Raises `BadDictionary`."""
        d = self._dicts.get(dict_id)
        if d is not None:  # an ID names one content: nothing to check again
            return d
        d = checked(dict_id, data)
        with self._lock:
            d = self._dicts.setdefault(dict_id, d)
            self._missing.pop(dict_id, None)
        return d

    def __contains__(self, dict_id: object) -> bool:
        return dict_id in self._dicts

    def get(self, dict_id: int) -> zstandard.ZstdCompressionDict:
        """The dictionary `dict_id`, from the cache or a loader. Raises `UnknownDictionary`, or
        `BadDictionary` for bytes that do not match the ID or are not a dictionary."""
        d = self._dicts.get(dict_id)
        if d is not None:
            return d
        for load in self.loaders:
            data = load(dict_id)
            if data is not None:
                try:
                    return self.add(dict_id, data)
                except BadDictionary as exc:
                    self.missing(dict_id, exc)
                    raise
        _, error = self._missing.get(dict_id, (0.0, None))
        # a copy: the one recorded error raised for every entry would chain their tracebacks
        raise UnknownDictionary(dict_id) if error is None else copy.copy(error)

    def missing(self, dict_id: int, why: str | DecodeError) -> None:
        """Record that `dict_id` could not be loaded: `why` is where it was looked for, or the
        error its bytes raised; decoding raises it (`get`)."""
        error = why if isinstance(why, DecodeError) else UnknownDictionary(dict_id, why)
        self._missing[dict_id] = (time.monotonic(), error)

    def recently_missing(self, dict_id: int) -> bool:
        seen = self._missing.get(dict_id)
        return seen is not None and time.monotonic() - seen[0] < _MISSING_RETRY_S


CACHE = DictionaryCache()


def dictionary_id(data: bytes) -> int | None:
    """The dictionary ID an entry's ``data`` field needs (None for formats without one). Raises
    `DecodeError` for a field too short to hold one."""
    if not data or data[0] not in DICT_FORMATS:
        return None
    if len(data) <= ID_BYTES:
        raise DecodeError("truncated dictionary ID")
    return int.from_bytes(data[1 : 1 + ID_BYTES], "big")


def parse_id(raw: bytes | str) -> int:
    """A dictionary ID as Redis stores it (decimal text of an unsigned 64-bit integer). Raises
    `ValueError` for anything else."""
    text = raw.decode("ascii") if isinstance(raw, bytes) else raw
    if not text.isdigit() or len(text) > 20 or (len(text) > 1 and text[0] == "0"):
        raise ValueError(f"{text[:40]!r} is not a dictionary ID")
    value = int(text)
    if value >= 1 << 64:
        raise ValueError(f"{text!r} is not a dictionary ID")
    return value


class Dictionaries:
    """A topic's dictionaries in Redis: train, read the current one, load by ID into `CACHE`."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._current: dict[str, tuple[float, int | None]] = {}  # topic -> (checked at, id)

    async def train(self, topic: str, samples: Iterable[bytes], size: int = DEFAULT_SIZE) -> int:
        """Train a dictionary of `size` bytes from `samples` (MessagePack bodies), store it as the
        topic's new current version, and return its ID (`fingerprint`). A version is written
        once (``HSETNX``): an ID already stored keeps its bytes. Raises `ConfigError` when zstd
        cannot train from the samples (too few, or too alike)."""
        bodies: list[Any] = list(samples)
        try:  # the ID zstd writes inside the dictionary is unused (frames carry none)
            trained = zstandard.train_dictionary(
                size, bodies, dict_id=random.randrange(1 << 15, 1 << 31), level=LEVEL
            )
        except zstandard.ZstdError as exc:
            raise ConfigError(
                f"topic {topic!r}: cannot train a dictionary from {len(bodies)} samples ({exc})"
            ) from None
        data = trained.as_bytes()
        dict_id = fingerprint(data)
        CACHE.add(dict_id, data)  # checked before any entry can name it
        key = self.keys.dictionaries(topic)
        if not await self.redis.hsetnx(key, str(dict_id), data):
            stored = await self.redis.hget(key, str(dict_id))
            if stored != data:  # only a planted value can differ: never move `current` to it
                raise ConfigError(f"topic {topic!r}: {key} holds other bytes under ID {dict_id}")
        await self.redis.hset(key, CURRENT, str(dict_id))
        return dict_id

    async def versions(self, topic: str) -> tuple[int | None, dict[int, int]]:
        """(the current ID, {ID: size in bytes} of every stored version) of `topic`. Raises
        `ConfigError` for a field that is not a dictionary ID (written by something else)."""
        raw = await self.redis.hgetall(self.keys.dictionaries(topic))
        try:
            current = raw.pop(CURRENT, None)
            return (None if current is None else parse_id(current)), {
                parse_id(k): len(v) for k, v in raw.items()
            }
        except ValueError as exc:
            raise ConfigError(f"topic {topic!r}: {self.keys.dictionaries(topic)}: {exc}") from None

    async def current(self, topic: str) -> int | None:
        """The ID new entries of `topic` use (None: no dictionary), loaded into `CACHE`; asks
        Redis at most every `REFRESH_S` seconds. A ``current`` field that names no valid
        dictionary (not an ID, not stored, bytes that do not match the ID or are no zstd
        dictionary) or that Redis refuses to read is logged at ERROR, and the dictionary used
        so far stays in use. Raises only connection errors."""
        now = time.monotonic()
        checked_at = self._current.get(topic)
        if checked_at is not None and now - checked_at[0] < REFRESH_S:
            return checked_at[1]
        previous = None if checked_at is None else checked_at[1]
        self._current[topic] = (now, previous)  # concurrent callers do not ask again meanwhile
        key = self.keys.dictionaries(topic)
        try:
            raw = await self.redis.hget(key, CURRENT)
        except ResponseError as exc:  # e.g. NOPERM, WRONGTYPE: the server's reason, logged
            log.error(
                "topic %s: cannot read its zstd dictionary (%s); keeping %s",
                topic,
                exc,
                _shown(previous),
            )
            return previous
        if raw is None:
            self._current[topic] = (now, None)
            return None
        try:
            dict_id = parse_id(raw)
        except ValueError as exc:
            log.error(
                "topic %s: field current of %s: %s; keeping %s", topic, key, exc, _shown(previous)
            )
            return previous
        if dict_id not in CACHE:
            why = await self._load(topic, dict_id)
            if why is not None:
                log.error("topic %s: %s; keeping %s", topic, why, _shown(previous))
                return previous
        self._current[topic] = (now, dict_id)
        return dict_id

    def due(self, topic: str) -> bool:
        """Whether `current(topic)` would ask Redis (never asked, or `REFRESH_S` passed)."""
        checked_at = self._current.get(topic)
        return checked_at is None or time.monotonic() - checked_at[0] >= REFRESH_S

    def cached_current(self, topic: str) -> int | None:
        checked_at = self._current.get(topic)
        return None if checked_at is None else checked_at[1]

    async def ensure(self, topic: str, data: bytes) -> None:
        """Load the dictionary an entry's ``data`` needs into `CACHE`, if any and not there.
        Raises only connection errors: a dictionary missing, refused by Redis (an error reply
        such as WRONGTYPE or NOPERM: not retried) or not valid is recorded, and decoding then
        raises `UnknownDictionary` or `BadDictionary` with the reason."""
        try:
            dict_id = dictionary_id(data)
        except DecodeError:
            return
        if dict_id is None or dict_id in CACHE or CACHE.recently_missing(dict_id):
            return
        await self._load(topic, dict_id)

    async def _load(self, topic: str, dict_id: int) -> DecodeError | None:
        """Load `dict_id` from `topic`'s hash into `CACHE`; None, or why it could not (also
        recorded in `CACHE`). Raises only connection errors."""
        key = self.keys.dictionaries(topic)
        try:
            data = await self.redis.hget(key, str(dict_id))
        except ResponseError as exc:
            error: DecodeError = UnknownDictionary(dict_id, f"Redis refused HGET {key}: {exc}")
        else:
            if data is None:
                error = UnknownDictionary(dict_id, f"not in Redis hash {key}")
            else:
                try:
                    CACHE.add(dict_id, data)
                    return None
                except BadDictionary as exc:
                    error = BadDictionary(dict_id, f"{exc.why} (Redis hash {key})")
        CACHE.missing(dict_id, error)
        return error


def _shown(dict_id: int | None) -> str:
    return "no dictionary" if dict_id is None else f"dictionary {dict_id}"
