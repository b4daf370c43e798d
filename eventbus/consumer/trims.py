"""Entries trimmed before the group read them: detected, counted and recorded, never silent.

``XADD ... MAXLEN ~`` (the memory cap) may trim entries a group has not read yet, and
``XREADGROUP ... >`` then goes on from the stream's first entry without a word. Redis 7's
counters expose it: a group's ``lag`` is ``entries-added - entries-read``, and ``entries-read``
counts the entries delivered to the group, so trimmed unread entries stay in the lag for ever,
while the stream holds fewer entries after the group's last-delivered ID than the lag says. Their
difference is the number of entries the group lost to trimming. The consumer computes it for
every shard it holds, when it takes the shard and every `TrimWatch.interval_s` seconds
(``XINFO STREAM`` + ``XINFO GROUPS``, and ``XRANGE`` to count the entries after the last-delivered
ID when that lies inside the stream and some entries ever left it: ``entries-added`` above
``length``; a stream nothing left has lost nothing), and reports any increase:

* **ahead**: the last-delivered ID lies before the stream's first entry: the entries are gone
  and the group has not read past them yet (with an archive, catch-up handles them from the
  segments);
* **read past**: the group already went on past them.

Either is logged at ERROR, counted in ``eventbus_trimmed_unread_total`` and recorded in the
group's trim records (`Keys.trimmed`, shown by ``eventbus stats``). The same
``XINFO GROUPS`` sets the ``eventbus_consumer_lag`` gauge of each shard checked. When Redis
does not know the group's ``entries-read`` (after ``XGROUP SETID`` without ``ENTRIESREAD``, as
the catch-up moves a group, or an AOF reload) nothing is counted: its ``lag`` is then missing, or,
once the group's position lies before the stream's first entry, Redis *estimates* it as the
stream's length (which counts nothing trimmed). Such a shard is returned as `uncounted` when
entries after the group's position may have left the stream, for the consumer's catch-up hook
to tell from the archive. A backlog over `COUNT_LIMIT` entries inside the stream is not
counted (too costly) until it shrinks or the head passes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from eventbus.consumer.shards import HeldShard
from eventbus.locking.member import Member
from eventbus.ops.metrics import METRICS
from eventbus.protocol.ids import parse_id as _id

log = logging.getLogger("eventbus.consumer")

RECORDS_MAXLEN = 10_000  # trim records kept per group (approximately)
COUNT_LIMIT = 10_000  # most entries counted with XRANGE in one check
IDLE_EVERY = 12
"""A shard whose group had read all of it at its last check, and whose reads since all came back
empty, is checked every `IDLE_EVERY` times `TrimWatch.interval_s` rather than every interval
(`TrimWatch.due`): nothing was added to it that a ``MAXLEN`` trim could take unread. 100 idle
groups of a 16-shard topic in one process sent 320 ``XINFO STREAM`` a second for nothing."""


@dataclass(slots=True)
class _Baseline:
    generation: int
    lost: int | None  # entries the group had lost to trimming at the last check
    checked_at: float = 0.0
    # the stream's `_shape` at the last check, when the group had read all of it (lag 0)
    caught_up: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class Trim:
    """Unread entries of `shard` found trimmed: `count` of them, after entry ID `after` (the
    group's last-delivered ID then) and before `before` (the stream's first entry, or "")."""

    shard: int
    count: int
    after: str
    before: str
    ahead: bool


@dataclass(frozen=True, slots=True)
class TrimCheck:
    """What one `TrimWatch.check` found: the trims counted (`found`, recorded), and the shards
    whose trims Redis could not count while their group's position lies before the stream's
    first entry (`uncounted`: the group's ``entries-read`` unknown)."""

    found: list[Trim]
    uncounted: list[int]


class TrimWatch:
    """The trim checks of one consumer; see the module docstring."""

    def __init__(self, member: Member) -> None:
        self.redis, self.group, self.consumer_id = member.redis, member.group, member.consumer_id
        self.interval_s = member.settings.trim_check_s
        self._topic = member.topic
        self._records = member.keys.trimmed(member.topic, member.group)
        self._base: dict[int, _Baseline] = {}
        self._m_trimmed = METRICS.trimmed_unread.labels(member.topic, member.group)

    def due(self, held: list[HeldShard], now: float) -> list[HeldShard]:
        """Shards to check now: newly held ones, and those not checked for `interval_s`, but
        for an idle one: found caught up at its last check and read empty at every read since
        (`HeldShard.idle_since` no later than that check), it waits `IDLE_EVERY` intervals. The
        newest entry of a stream survives every ``MAXLEN`` trim, so had anything been added
        since, a read (``>``) would have returned it; an operator's ``XTRIM``/``XDEL`` of every
        new entry between two reads stays in the group's lag and is counted by the check after
        the next read that gets entries, or at the latest `IDLE_EVERY` intervals on."""

        def is_due(h: HeldShard) -> bool:
            base = self._base.get(h.shard)
            if base is None or base.generation != h.generation:
                return True
            since = now - base.checked_at
            if since < self.interval_s:
                return False
            idle = h.idle_since
            if base.caught_up is not None and idle is not None and idle <= base.checked_at:
                return since >= self.interval_s * IDLE_EVERY
            return True

        return [h for h in held if is_due(h)]

    async def check(self, shards: list[HeldShard]) -> TrimCheck:
        """Check `shards`; record the trims found since their last check; return them and the
        shards whose trims cannot be counted (`TrimCheck`). Raises the error replies of ``XINFO
        STREAM`` and ``XINFO GROUPS`` but "no such key" (a stream not created yet), as the
        broadcast check does: a check Redis refuses (NOPERM without ``+xinfo|stream``) fails
        the round, logged and counted as a refusal, instead of turning the check off.

        A shard whose group had read all of it at its last check (lag 0), and whose stream has
        had nothing added, trimmed or deleted since (``XINFO STREAM``), is not asked ``XINFO
        GROUPS``: its lag is still 0 and it lost nothing (an operator's ``XGROUP SETID`` on
        such a stream shows in the lag gauge once an entry is added). That reply lists every
        group of the stream, so idle groups of one topic each paid for all the others at every
        check."""
        pipe = self.redis.pipeline(transaction=False)
        for h in shards:
            pipe.xinfo_stream(h.stream)
        infos = await pipe.execute(raise_on_error=False)
        now = time.monotonic()
        asked = []
        for h, info in zip(shards, infos, strict=True):
            if _missing(info):
                continue  # no stream yet (any other error reply was raised)
            base = self._base.get(h.shard)
            # (caught_up None: the group was not caught up at the last check)
            if (
                base is not None
                and base.generation == h.generation
                and (base.caught_up == _shape(info))
            ):
                base.checked_at = now
                continue
            asked.append((h, info))
        if not asked:
            return TrimCheck([], [])
        pipe = self.redis.pipeline(transaction=False)
        for h, _ in asked:
            pipe.xinfo_groups(h.stream)
        replies = await pipe.execute(raise_on_error=False)
        found, uncounted = [], []
        for (h, info), groups in zip(asked, replies, strict=True):
            if _missing(groups):
                continue
            group = next((g for g in groups if _text(g["name"]) == self.group), None)
            if group is None:
                continue
            # the metric, while the check has XINFO at hand: NaN when Redis cannot compute the
            # lag (not the last value seen, which would look current)
            lag = group.get("lag")
            METRICS.lag.labels(self._topic, self.group, h.shard).set(
                float("nan") if lag is None else int(lag)
            )
            if group.get("entries-read") is None and _gap_before_head(info, group):
                uncounted.append(h.shard)
                # counted afresh once Redis knows it again; checked again in `interval_s`
                self._base[h.shard] = _Baseline(h.generation, None, now)
                continue
            trim = await self._compare(h, info, group, now)
            if trim is not None:
                found.append(trim)
            if lag is not None and int(lag) == 0:
                self._base[h.shard].caught_up = _shape(info)
        for trim in found:
            await self._record(trim)
        return TrimCheck(found, uncounted)

    async def _compare(self, h: HeldShard, info: Any, group: Any, now: float) -> Trim | None:
        old = self._base.get(h.shard)
        known = old.lost if old is not None and old.generation == h.generation else None
        lost = await self._lost(h, info, group)
        self._base[h.shard] = _Baseline(h.generation, lost, now)
        if lost is None:
            return None
        delivered_id = _text(group["last-delivered-id"])
        first = info.get("first-entry")
        first_id = _text(first[0]) if first else ""
        ahead = not first or _id(first_id) > _id(delivered_id)
        # on a new shard only entries still ahead are ours to report (the rest were lost, and
        # reported, before: the lag keeps them for ever)
        new = lost - known if known is not None else (lost if ahead else 0)
        if new <= 0:
            return None
        if ahead:
            return Trim(h.shard, new, delivered_id, first_id, True)
        return Trim(h.shard, new, "", delivered_id, False)

    async def _lost(self, h: HeldShard, info: Any, group: Any) -> int | None:
        """Entries the group lost to trimming so far: its lag minus the entries the stream holds
        after its last-delivered ID; None when Redis does not know the lag, or it is too long
        to count."""
        lag = group.get("lag")
        if lag is None:
            return None
        if info.get("entries-added") == info["length"]:
            # nothing ever left the stream, so no entry was trimmed unread: the lag is exactly
            # the entries after the last-delivered ID (not fetched: a backlog of N entries cost
            # N entries moved and parsed, one XRANGE round trip per shard, at every check)
            return 0
        delivered_id = _text(group["last-delivered-id"])
        first = info.get("first-entry")
        if not first or _id(_text(first[0])) > _id(delivered_id):
            after = int(info["length"])
        elif int(lag) > COUNT_LIMIT:
            return None
        else:
            rows = await self.redis.xrange(h.stream, min="(" + delivered_id, count=int(lag) + 1)
            after = len(rows)
        return max(0, int(lag) - after)

    async def _record(self, trim: Trim) -> None:
        self._m_trimmed.inc(trim.count)
        log.error(
            "consumer %s: %d entries of shard %d were trimmed before group %s read them "
            "(%s; MAXLEN too small for the backlog? see docs/operations.md, stream caps)",
            self.consumer_id,
            trim.count,
            trim.shard,
            self.group,
            f"after {trim.after or '?'} before {trim.before or 'the end'}"
            if trim.ahead
            else f"read past them, up to {trim.before}",
        )
        await self.redis.xadd(
            self._records,
            {
                b"shard": str(trim.shard).encode(),
                b"count": str(trim.count).encode(),
                b"after": trim.after.encode(),
                b"before": trim.before.encode(),
                b"ahead": b"1" if trim.ahead else b"0",
                b"consumer": self.consumer_id.encode(),
            },
            maxlen=RECORDS_MAXLEN,
            approximate=True,
        )


def _gap_before_head(info: Any, group: Any) -> bool:
    """Whether the stream's first entry (its next ID when empty) lies after the successor of the
    group's last-delivered ID, and entries ever left the stream: what the group has not read
    may have been trimmed."""
    if info.get("entries-added") == info["length"]:
        return False
    delivered = _id(_text(group["last-delivered-id"]))
    first = info.get("first-entry")
    head = _id(_text(first[0])) if first else _id(_text(info["last-generated-id"])).next()
    return head > delivered.next()


def _shape(info: Any) -> tuple[Any, ...]:
    """What an ``XINFO STREAM`` reply says of the entries added, held and first: equal at two
    checks when nothing was added, trimmed or deleted in between."""
    first = info.get("first-entry")
    return (
        info.get("entries-added"),
        info["length"],
        info.get("last-generated-id"),
        info.get("max-deleted-entry-id"),
        first[0] if first else None,
    )


def _missing(reply: Any) -> bool:
    """Whether an ``XINFO`` reply says the stream does not exist; raises any other error
    reply."""
    if isinstance(reply, Exception):
        if "no such key" not in str(reply).lower():
            raise reply
        return True
    return False


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
