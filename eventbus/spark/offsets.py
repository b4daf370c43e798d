"""Offsets of ``format("eventbus")``, keyed by topic as Kafka's.

An offset is ``{"<topic>": {"<shard>": "<ms>-<seq>"}}``.

Per subscribed topic (``subscribe``, else ``topic``), per shard, an entry ID: a stream's
checkpointed offset is the last entry read (``"0-0"``: none); ``startingOffsets`` /
``endingOffsets`` bound a read. `parse_start` reads the option text, `by_topic` a stream offset
from Spark's checkpoint, refusing one written for another topic set (its entry IDs would be
taken as this read's: a silent misread). `share` splits ``maxOffsetsPerTrigger`` over the
(topic, shard) pairs with new entries in proportion to their lag, as Kafka's source does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from eventbus.errors import ConfigError
from eventbus.protocol.ids import ZERO, EntryId, parse_id

Offset = dict[str, str]
"""One topic's offset: shard (decimal text) -> entry ID text."""
Offsets = dict[str, Offset]
"""topic -> its `Offset`."""


def parse_start(
    text: str,
    topic: str | None = None,
    subscribed: Sequence[str] = (),
    name: str = "startingOffsets",
) -> str | Offset | int:
    """Option `name`'s value for `topic`: ``earliest``/``latest``, a JSON offset (an `Offset`,
    ``{"<shard>": "<entry ID>"}``, only when one topic is read, or Kafka's form keyed by topic,
    ``{"<topic>": {"<shard>": "<entry ID>"}}``, which must name every topic of `subscribed`
    (default: `topic`) and no other), or a time as Unix ms (int; from an ISO-8601 text too,
    UTC without an offset). Raises `ConfigError` naming the option."""
    topics = tuple(subscribed) or ((topic,) if topic is not None else ())
    value = text.strip()
    if value.lower() in ("earliest", "latest"):
        return value.lower()
    if value.startswith("{"):
        try:
            return _json_offset(value, topic, topics)
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"option {name}: bad JSON offset {value!r}: {exc}") from None
    if value.isdigit():
        return int(value)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"option {name} must be earliest, latest, a JSON offset "
            f'({{"0": "1700000000000-0"}}), Unix ms or an ISO-8601 time; got {value!r}'
        ) from None
    return int(when.replace(tzinfo=when.tzinfo or UTC).timestamp() * 1000)


def _json_offset(value: str, topic: str | None, topics: tuple[str, ...]) -> Offset:
    raw = json.loads(value)  # an object: `value` starts with "{"
    if raw and all(isinstance(v, dict) for v in raw.values()):
        if topic not in raw:
            raise ConfigError(f"it names topics {sorted(raw)}, not {topic!r}")
        others = sorted(set(raw) - set(topics))
        if others:
            raise ConfigError(f"it names topics {others} the read does not subscribe to")
        raw = raw[topic]
    elif raw and len(topics) > 1:
        raise ConfigError(
            f"a read of several topics ({', '.join(topics)}) takes offsets keyed by topic, "
            '{"<topic>": {"<shard>": "<entry ID>"}}'
        )
    return {str(int(k)): _entry_id(k, v) for k, v in raw.items()}


def _entry_id(shard: Any, value: Any) -> str:
    """Shard `shard`'s offset `value` as entry ID text. Kafka's numeric offsets (``23``,
    ``-1`` for latest, ``-2`` for earliest), which a bare number would be read as an entry ID
    of that millisecond, are refused (`ConfigError`)."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or not _ENTRY_ID.fullmatch(text):
        raise ConfigError(
            f"shard {shard}: {value!r} is not an entry ID; offsets here are Redis entry IDs, "
            '"<ms>-<seq>" text such as "1700000000000-0", not Kafka\'s numeric offsets'
        )
    return str(parse_id(text))


_ENTRY_ID = re.compile(r"\d+-\d+")


def by_topic(offset: Mapping[str, Any], topics: Sequence[str]) -> Offsets:
    """A stream offset as Spark hands it back from its checkpoint, per topic of `topics` (the
    read's). An offset keyed by other topics raises `ConfigError` (a checkpointLocation serves
    one topic set); one keyed by shard only (written before offsets were keyed by topic) is
    taken as the offset of a one-topic read, and refused for several topics."""
    if not offset:
        return {t: {} for t in topics}
    if all(isinstance(v, dict) for v in offset.values()):
        if set(offset) != set(topics):
            raise ConfigError(
                f"the query's checkpoint holds offsets of topic(s) {sorted(offset)}, not "
                f"{sorted(topics)}: a checkpointLocation serves one topic set; use a new "
                "checkpointLocation for another topic or topic set"
            )
        return {t: {str(k): str(v) for k, v in offset[t].items()} for t in topics}
    if len(topics) > 1:
        raise ConfigError(
            "the query's checkpoint holds offsets of one topic (per shard, written before "
            f"offsets were keyed by topic), not of {sorted(topics)}: use a new checkpointLocation"
        )
    return {topics[0]: {str(k): str(v) for k, v in offset.items()}}


def share(total: int, lags: Sequence[int]) -> list[int]:
    """``maxOffsetsPerTrigger`` = `total` entries split over (topic, shard) pairs that have
    `lags` entries waiting each, as Kafka's source splits it over partitions: in proportion to
    the lag, so that a shard far behind is not starved and shards nearly caught up are not
    over-read. Each pair gets at least one entry when `total` allows (Kafka's "don't starve
    small partitions"), the rest of `total` in proportion to the lags less that one (largest
    remainders, earlier pairs first on ties); with fewer entries than pairs, the first `total`
    pairs get one (the caller's order: least advanced first). A lag below 1 counts as 1. No
    quota exceeds its pair's lag and the quotas sum to ``min(total, sum(lags))``: never more
    than `total`. Raises `ValueError` for a negative `total`."""
    if total < 0:
        raise ValueError(f"a per-trigger limit must be >= 0, got {total}")
    waiting = [max(1, lag) for lag in lags]
    n = len(waiting)
    if sum(waiting) <= total:
        return waiting
    if total < n:
        return [1 if i < total else 0 for i in range(n)]
    rest = total - n
    weights = [lag - 1 for lag in waiting]
    whole = sum(weights)  # > rest: sum(waiting) > total
    quotas = [1 + rest * w // whole for w in weights]
    by_remainder = sorted(range(n), key=lambda i: (-(rest * weights[i] % whole), i))
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


def initial_offset(start: str | Offset | int, heads: dict[int, EntryId]) -> Offset:
    """A new query's offset of one topic: `start` (`parse_start`'s value) at `heads`."""
    if start == "latest":
        return {str(s): str(h) for s, h in heads.items()}
    if isinstance(start, int):
        at = EntryId(start, 0)
        return {str(s): str(at.prev()) if start > 0 else "0-0" for s in heads}
    given = start if isinstance(start, dict) else {}
    return {str(s): given.get(str(s), "0-0") for s in heads}


def starts_beyond(start: str | Offset | int, heads: dict[int, EntryId]) -> list[str]:
    """The shards a new query's JSON `start` places past their last entry (`heads`)."""
    if not isinstance(start, dict):
        return []
    return [
        f"shard {k} at {v}, last entry {heads.get(int(k), 'none')}"
        for k, v in start.items()
        if parse_id(v) > heads.get(int(k), ZERO)
    ]
