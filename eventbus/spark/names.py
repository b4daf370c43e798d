"""The option names of ``format("eventbus")``: Kafka-source style camelCase, the older names as
aliases, and an unknown (say, misspelled) name refused with the closest known one.

Spark hands a data source its options with case-insensitive names; `canonical` returns them
under the lowercased camelCase name (``redisurl`` for ``redis_url``, ``redisUrl``, ``REDISURL``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from eventbus.errors import ConfigError

NAMES = (
    "store",
    "topic",
    "subscribe",
    "redisUrl",
    "model",
    "mode",
    "validate",
    "shards",
    "keyPrefix",
    "hashtag",
    "coordinationSlots",
    "packBytes",
    "pushdown",
    "native",
    "onGap",
    "failOnDataLoss",
    "table",
    "storeFactory",
    "s3Endpoint",
    "s3Region",
    "startingOffsets",
    "startingTimestamp",
    "endingOffsets",
    "maxOffsetsPerTrigger",
    "resourceIdCol",
    "eventIdCol",
    "eventType",
    "headersCol",
    "path",  # Spark's own, from load(path) / save(path): unused
)
ALIASES = {
    "redis_url": "redisUrl",
    "key_prefix": "keyPrefix",
    "coordination_slots": "coordinationSlots",
    "store_factory": "storeFactory",
    "s3_endpoint": "s3Endpoint",
    "s3_region": "s3Region",
    "maxEntriesPerTrigger": "maxOffsetsPerTrigger",
    "resource_id_col": "resourceIdCol",
    "event_id_col": "eventIdCol",
    "event_type": "eventType",
    "headers_col": "headersCol",
}
INTERNAL = ("_ranges", "_plan")  # set by `eventbus.spark.native` / `.native_stream`

_BY_LOWER = {n.lower(): n for n in (*NAMES, *INTERNAL)}
_ALIAS_LOWER = {a.lower(): t.lower() for a, t in ALIASES.items()}


def canonical(options: Mapping[str, str]) -> dict[str, str]:
    """`options` keyed by lowercased canonical name. Raises `ConfigError` for an unknown name
    (naming the closest known one) or for a name given twice (as itself and as an alias) with
    two values."""
    out: dict[str, str] = {}
    given: dict[str, str] = {}
    for name, value in options.items():
        low = name.lower()
        key = _ALIAS_LOWER.get(low, low)
        if key not in _BY_LOWER:
            raise ConfigError(f"unknown option {name!r}{_hint(low)}")
        if key in out and out[key] != value:
            raise ConfigError(
                f"option {_BY_LOWER[key]} given twice, as {given[key]!r} and {name!r}, with "
                f"different values ({out[key]!r}, {value!r})"
            )
        out[key], given[key] = value, name
    return out


def shown(key: str) -> str:
    """The option's name as documented (camelCase) for `key`, a lowercased canonical name."""
    return _BY_LOWER.get(key, key)


def _hint(low: str) -> str:
    known = {n.lower(): n for n in NAMES} | {a.lower(): a for a in ALIASES}
    close = difflib.get_close_matches(low, list(known), n=1, cutoff=0.6)
    if close:
        return f": did you mean {known[close[0]]!r}?"
    return f"; the options are {', '.join(NAMES[:-1])}"
