"""Dead-letter records and control entries: their fields on the wire (what an operator's
tool in another language must read and write; `eventbus.dlq` is the operator API over them).

Each (topic, group) has one dead-letter stream (`Keys.dead_letter`). A dead-letter entry holds
the original entry's fields (``orig_rid``, ``orig_type``, ``orig_data``) and why it is there:

==================  =========================================================================
field               meaning
==================  =========================================================================
``topic``/``group`` where it was consumed
``shard``           shard it was read from; ``entry_id``: its entry ID there
``reason``          ``failed`` (handler failed ``attempts`` times), ``undecodable`` (bad bytes,
                    missing field, unknown type, payload failing validation), ``parked`` (its
                    resource was parked: not attempted), ``forged`` (a control entry without
                    a recorded request: not executed)
``error_type``      exception class name; ``error``: its message (first 4 KiB)
``traceback``       the exception's traceback as Python prints it (its last 4 KiB)
``attempts``        handler attempts made (0 when not attempted)
``failed_at_ms``    Unix time (ms) it was dead-lettered
==================  =========================================================================

A *control entry* is an ordinary envelope in a resource's shard stream whose event type is
`UNPARK` (``__eventbus.unpark``) or `DROP` (``__eventbus.drop``), its payload naming the group
and the nonce under which the operator recorded the request (`control_request`) in the group's
control hash (`Keys.control`). Consumers never hand a control entry to a handler (`is_control`).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass

from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    RESERVED_TYPE_PREFIX,
    Envelope,
    encode_entry,
    new_event_id,
)

CONTROL_PREFIX = RESERVED_TYPE_PREFIX
UNPARK = "__eventbus.unpark"
TRACEBACK_BYTES = 4096
DROP = "__eventbus.drop"

log = logging.getLogger("eventbus.dlq")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter entry, decoded. `dlq_id` is its entry ID in the dead-letter stream."""

    dlq_id: str
    shard: int
    entry_id: str
    resource_id: str | None
    event_type: str | None
    reason: str
    error_type: str
    error: str
    attempts: int
    failed_at_ms: int
    fields: dict[bytes, bytes]
    traceback: str = ""
    problems: tuple[str, ...] = ()
    """What is wrong with the entry when it was not written by eventbus (a number field that is
    not one, no original entry); empty for a well-formed dead letter."""

    @classmethod
    def parse(cls, dlq_id: bytes | str, f: dict[bytes, bytes]) -> DeadLetter:
        """Decode a dead-letter entry. Never raises: a field of the wrong form takes a default
        (-1 or 0) and is named in `problems`, so that one bad entry does not hide the others."""
        problems: list[str] = []

        def text(key: bytes) -> str | None:
            v = f.get(key)
            return v.decode("utf-8", "replace") if v is not None else None

        def number(key: bytes, default: int) -> int:
            v = f.get(key)
            if v is None:
                return default
            try:
                return int(v)
            except ValueError:
                problems.append(f"{key.decode()} is not an integer: {v[:40]!r}")
                return default

        if b"orig_" + F_DATA not in f:
            problems.append("no original entry (orig_data)")
        return cls(
            dlq_id=dlq_id.decode() if isinstance(dlq_id, bytes) else dlq_id,
            shard=number(b"shard", -1),
            entry_id=text(b"entry_id") or "",
            resource_id=text(b"orig_" + F_RESOURCE),
            event_type=text(b"orig_" + F_TYPE),
            reason=text(b"reason") or "failed",
            error_type=text(b"error_type") or "",
            error=text(b"error") or "",
            attempts=number(b"attempts", 0),
            failed_at_ms=number(b"failed_at_ms", 0),
            fields=f,
            traceback=text(b"traceback") or "",
            problems=tuple(problems),
        )

    def original(self) -> dict[bytes, bytes]:
        """The original entry's fields, as they were in the shard stream."""
        prefix = b"orig_"
        return {k[len(prefix) :]: v for k, v in self.fields.items() if k.startswith(prefix)}


def traceback_tail(exc: BaseException, limit: int = TRACEBACK_BYTES) -> bytes:
    """The last `limit` bytes of `exc`'s traceback as Python prints it (UTF-8; the innermost
    frames, where it was raised, are at the end)."""
    text = "".join(traceback.format_exception(exc)).encode("utf-8", "replace")
    if len(text) <= limit:
        return text
    return text[-limit:].decode("utf-8", "ignore").encode()


def dead_letter_fields(
    *,
    topic: str,
    group: str,
    shard: int,
    entry_id: bytes | str,
    reason: str,
    exc: BaseException | None,
    attempts: int,
    original: dict[bytes, bytes],
) -> dict[bytes, bytes]:
    """The fields of a dead-letter entry (see the table above); `original` is the entry's own
    field map, kept as ``orig_<name>``. The error message is cut to 4 KiB, the traceback to its
    last 4 KiB (`traceback_tail`)."""
    fields = {
        b"topic": topic.encode(),
        b"group": group.encode(),
        b"shard": str(shard).encode(),
        b"entry_id": entry_id if isinstance(entry_id, bytes) else entry_id.encode(),
        b"reason": reason.encode(),
        b"error_type": type(exc).__name__.encode() if exc else b"",
        # (backslashreplace: a message may hold lone surrogates, os.fsdecode's for one)
        b"error": str(exc).encode("utf-8", "backslashreplace")[:4096]
        if exc
        else b"resource is parked",
        b"traceback": traceback_tail(exc) if exc else b"",
        b"attempts": str(attempts).encode(),
        b"failed_at_ms": str(time.time_ns() // 1_000_000).encode(),
    }
    for name, value in original.items():
        fields[b"orig_" + name] = value
    return fields


def control_entry(
    kind: str, resource_id: str, group: str, *, nonce: str | None = None
) -> dict[bytes, bytes]:
    """Fields of a control entry asking `group`'s consumer to unpark or drop `resource_id`;
    `nonce` names the request recorded in the group's control hash (`control_request`)."""
    payload = {"group": group} if nonce is None else {"group": group, "nonce": nonce}
    env = Envelope(
        resource_id=resource_id,
        event_type=kind,
        event_id_bytes=new_event_id(),
        published_at_ms=time.time_ns() // 1_000_000,
        payload=payload,
    )
    return encode_entry(env, compress_threshold=1 << 30)


def control_request(kind: str, resource_id: str) -> bytes:
    """The value recorded under a control entry's nonce in `Keys.control`: what it may do."""
    return json.dumps({"kind": kind, "resource": resource_id}, sort_keys=True).encode()


def parked_resources(raw: dict[bytes, bytes], where: str) -> dict[str, str]:
    """A (topic, group)'s parked hash (`Keys.parked`: resource ID -> dead-letter ID of its first
    parked event) as read with HGETALL. A field that is not UTF-8 names no resource (resource IDs
    are UTF-8 strings: an entry whose ``rid`` is not is undecodable), so it is left out, with a
    warning naming `where` (the key) and the field; any other client may write the hash. A value
    that is not UTF-8 keeps its resource parked (its letters are found by resource ID, not by
    this value): it is decoded with replacement characters. Raises nothing."""
    parked: dict[str, str] = {}
    for field, value in raw.items():
        try:
            resource = field.decode()
        except UnicodeDecodeError:
            log.warning(
                "parked hash %s: field %r is not UTF-8 (no resource ID): ignored", where, field
            )
            continue
        parked[resource] = value.decode("utf-8", "replace")
    return parked


_CONTROL_PREFIX_BYTES = CONTROL_PREFIX.encode()


def is_control(fields: dict[bytes, bytes]) -> bool:
    """Whether a stream entry is a control entry (never given to handlers)."""
    return fields.get(F_TYPE, b"").startswith(_CONTROL_PREFIX_BYTES)


__all__ = [
    "CONTROL_PREFIX",
    "DROP",
    "TRACEBACK_BYTES",
    "UNPARK",
    "DeadLetter",
    "control_entry",
    "control_request",
    "dead_letter_fields",
    "is_control",
    "parked_resources",
    "traceback_tail",
]
