"""Every Redis key eventbus uses, built in this one module.

Two families, chosen for Redis Cluster (https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags):

* **Coordination keys** carry a hashtag, so that one Lua script may touch several of them
  atomically. Where the hashtag puts them is `Keys.slots` (setting ``coordination_slots``):

  - ``"shared"`` (the default): every coordination key contains the same hashtag, default
    ``{eventbus}``: one slot, so on a Cluster one node carries every group's coordination;
  - ``"topic"``: a topic's members, locks, lock epochs, parked and control hashes and offloader
    checkpoints carry ``{<hashtag>:<topic>}`` (one slot per topic: every script touches the keys
    of one topic only), so a Cluster spreads coordination over its nodes by topic. The topic
    registry, retention hash and zstd dictionaries stay under ``{<hashtag>}`` in both layouts.

  The two layouts name different keys: members of one layout do not see the other's locks, so
  a topic changes layout only through a stated stop and ``eventbus topic migrate-slots``
  (`eventbus.cli.migrate_slots`; docs/operations.md).
* **Data keys** (shard streams, dead-letter streams) carry no hashtag, so on a Cluster the
  shard streams of a topic spread over the nodes.

Topic and group names are restricted to ``[A-Za-z0-9_.-]`` (1-100 characters) so that keys never
contain the ``:`` separator, braces or spaces; ``.`` and ``..`` are refused (a topic is also a
folder of the durable tier) and so is a leading ``-`` (it reads as an option on a command line).
``docs/protocol.md`` lists the layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Self, get_args

from eventbus.errors import ConfigError, InvalidEventType, InvalidName

CoordinationSlots = Literal["shared", "topic"]
"""Where coordination keys hash on a Cluster (`Keys.slots`): one slot for all, or one per topic."""

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


def check_name(kind: str, name: str) -> str:
    """Return `name` if it is a valid topic, group or consumer name; raise `InvalidName` (a
    `ConfigError`) if not: 1-100 characters of ``[A-Za-z0-9_.-]``, not ``.`` or ``..``, not
    starting with ``-``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(kind, name, "not 1-100 characters of [A-Za-z0-9_.-]")
    if name in (".", ".."):
        raise InvalidName(kind, name, "'.' and '..' name folders of the durable tier")
    if name.startswith("-"):
        raise InvalidName(kind, name, "a leading '-' reads as a command-line option")
    return name


_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def check_event_type(name: object, where: str) -> str:
    """Return `name` if it is a valid event type name (1-200 characters of ``[A-Za-z0-9_.-]``);
    raise `InvalidEventType` (a `ConfigError`) naming `where` if not."""
    if not isinstance(name, str) or not _EVENT_TYPE.fullmatch(name):
        raise InvalidEventType(name, where)
    return name


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder: `prefix` namespaces data keys, `hashtag` groups coordination keys, `slots`
    says whether a topic's coordination keys share the one ``{<hashtag>}`` slot (``"shared"``)
    or have their own, ``{<hashtag>:<topic>}`` (``"topic"``; module docstring). Raises
    `ConfigError` for an invalid prefix, hashtag or layout."""

    prefix: str = "eventbus"
    hashtag: str = "eventbus"
    slots: CoordinationSlots = "shared"

    def __post_init__(self) -> None:
        check_name("key prefix", self.prefix)
        check_name("hashtag", self.hashtag)
        if self.slots not in get_args(CoordinationSlots):
            raise ConfigError(
                f"coordination slots {self.slots!r}: choose 'shared' (one hashtag for every "
                "topic) or 'topic' (a hashtag per topic)"
            )

    @property
    def _coord(self) -> str:
        return f"{self.prefix}:{{{self.hashtag}}}"

    @classmethod
    def of(cls, settings: Any) -> Self:
        """The layout `settings` (an `eventbus.config.Settings`, or anything with its
        ``key_prefix``, ``hashtag`` and ``coordination_slots``) configure."""
        return cls(settings.key_prefix, settings.hashtag, settings.coordination_slots)

    def _topic_coord(self, topic: str) -> str:
        """The start of `topic`'s own coordination keys: the shared ``<prefix>:{<hashtag>}``,
        or ``<prefix>:{<hashtag>:<topic>}`` in the per-topic layout (names hold no ``:`` or
        braces, so no topic's tag is another's)."""
        if self.slots == "shared":
            return self._coord
        return f"{self.prefix}:{{{self.hashtag}:{topic}}}"

    def topic_hashtag(self, topic: str) -> str:
        """The hashtag `topic`'s locks, members, epochs, parked and control hashes and
        checkpoints carry, braces included: ``{<hashtag>}`` or ``{<hashtag>:<topic>}``."""
        return self._topic_coord(topic).removeprefix(f"{self.prefix}:")

    # -- data keys (no hashtag: spread over a Cluster) --------------------------------------
    def stream(self, topic: str, shard: int) -> str:
        """The stream holding shard `shard` of `topic`: ``<prefix>:stream:<topic>:<shard>``."""
        return f"{self.prefix}:stream:{topic}:{shard}"

    def dead_letter(self, topic: str, group: str) -> str:
        """The dead-letter stream of `group` on `topic`: ``<prefix>:dlq:<topic>:<group>``."""
        return f"{self.prefix}:dlq:{topic}:{group}"

    def reply(self, topic: str, caller: str) -> str:
        """Stream of the replies to one caller's requests on `topic` (`eventbus.request`),
        capped and expiring: ``<prefix>:reply:<topic>:<caller>``. Per topic, so that an ACL can
        let only the roles answering `topic` write it (docs/security.md, "Responder")."""
        return f"{self.prefix}:reply:{topic}:{caller}"

    def trimmed(self, topic: str, group: str) -> str:
        """Stream of trim records of `group` on `topic`: unread entries found trimmed by
        ``MAXLEN ~`` (`eventbus.consumer.trims`): ``<prefix>:trimmed:<topic>:<group>``."""
        return f"{self.prefix}:trimmed:{topic}:{group}"

    # -- coordination keys of the deployment (``{<hashtag>}`` in both layouts) ----------------
    def topics(self) -> str:
        """Hash: topic name -> shard count, written once on a topic's first use."""
        return f"{self._coord}:topics"

    def retention(self) -> str:
        """Hash: topic name -> ``acked`` for topics whose entries Redis keeps until every group
        acked them (`eventbus.protocol.retention`); read by the offloader."""
        return f"{self._coord}:retention"

    def dictionaries(self, topic: str) -> str:
        """Hash of a topic's zstd dictionaries (`eventbus.protocol.dictionaries`): ``<id>`` -> the
        dictionary's bytes (the ID is their fingerprint), ``current`` -> the ID new entries
        use. Under ``{<hashtag>}`` in both layouts: read once per process and cached, written
        by an operator, never in a script with other keys."""
        return f"{self._coord}:dict:{topic}"

    # -- coordination keys of one topic (``{<hashtag>}``, or ``{<hashtag>:<topic>}``) ---------

    def locks(self, topic: str, group: str) -> str:
        """Hash of a group's shard locks: ``<shard>`` -> owner consumer ID, ``<shard>:token`` ->
        fencing token (incremented on every change of owner)."""
        return f"{self._topic_coord(topic)}:locks:{topic}:{group}"

    def lock_epoch(self, topic: str, group: str) -> str:
        """Hash: ``n`` -> a group's coordination epoch, incremented by the lock scripts whenever
        a member joins, is dropped or leaves, or locks are released (``lua/lock_shards.lua``);
        ``since`` -> the Redis server time (ms) the hash was made.
        Named ``locks:epoch:<topic>:<group>``: the roles' ACL patterns of the locks
        (``locks:*``, ``locks:*:_offloader``) cover it, with the hash commands they allow."""
        return f"{self._topic_coord(topic)}:locks:epoch:{topic}:{group}"

    def members(self, topic: str, group: str) -> str:
        """Sorted set of a group's live consumers: member = consumer ID, score = the Redis server
        time (ms) at which its liveness expires unless refreshed."""
        return f"{self._topic_coord(topic)}:members:{topic}:{group}"

    def parked(self, topic: str, group: str) -> str:
        """Hash of a group's parked resources: resource ID -> dead-letter ID of its first parked
        event. A consumer reads it whenever it takes a shard lock."""
        return f"{self._topic_coord(topic)}:parked:{topic}:{group}"

    def control(self, topic: str, group: str) -> str:
        """Hash of the operator's pending requests to a group: nonce (hex) -> the request (JSON:
        kind, resource). Written only by ``eventbus dlq`` (publishers' ACL cannot); a consumer
        executes a control entry only if its nonce is here, and deletes it once done."""
        return f"{self._topic_coord(topic)}:control:{topic}:{group}"

    def dedup(self, topic: str, group: str, event_id: bytes) -> str:
        """String marking an event ID as handled by a group (optional de-duplication window)."""
        return f"{self.prefix}:dedup:{topic}:{group}:{event_id.hex()}"

    def checkpoints(self, topic: str) -> str:
        """Hash: shard -> last entry ID the offloader has archived (durable tier)."""
        return f"{self._topic_coord(topic)}:checkpoints:{topic}"
