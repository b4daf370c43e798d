"""An entry on its way through the handling path, and the vocabulary of that path: `Delivery`,
`Fence` (the caller's right to handle it), `Outcome`/`Step` (where it stands after a step),
`Tally` (what became of the entries)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

if TYPE_CHECKING:
    from eventbus.consumer.context import HandlerCall
    from eventbus.consumer.handling import Handling
    from eventbus.errors import DecodeError
    from eventbus.protocol.codec import Envelope


class Outcome(enum.Enum):
    """Where an entry stands after a step (a float instead means: retry after that many s)."""

    ACK = "ack"
    """Finished: handled, skipped as a duplicate, dead-lettered, or a control entry executed."""
    LET_GO = "let-go"
    """Not finished and not ours any more (shard lost, or stopping): it stays pending for the
    shard's next owner, unacked."""


Step = Outcome | float


async def wait_retry(delay_s: float, stopping: anyio.Event) -> None:
    """Wait out a retry delay of `delay_s` seconds, or less: until `stopping` is set.

    The one way a handler retry waits (per-event, batch, broadcast, parked-letter replay,
    catch-up). On shutdown the wait ends at once, so the entry is stepped again right away: a
    group consumer's fence then refuses it and it is let go, pending for the shard's next owner
    (`Outcome.LET_GO`); a broadcast consumer tries it within its `shutdown_grace_s`, as it
    would drop it otherwise.
    """
    with anyio.move_on_after(delay_s):
        await stopping.wait()


class NotStarted(enum.Enum):
    NOT_STARTED = "not-started"


NOT_STARTED = NotStarted.NOT_STARTED
"""`Handling.attempt`'s answer when the fence no longer held: the handler was not called."""


class Delivery(msgspec.Struct, eq=False):
    """An entry being handled: its shard and the fencing token under which it was read.

    `generation` identifies the lock acquisition in this process (0 for catch-up); `attempt`
    counts handler attempts made so far; `segment` names the object an archived entry came from;
    `delivery_count` is how often the group delivered the entry (the PEL's count, 1 at first).

    Decoded ahead of its turn, with the other entries of its read (`Handling.prepare`): `env`
    and `event` (the handler's argument) and `call` (the handler its type is routed to), or
    `error` when it does not decode or validate; all None when it is left to its turn (a
    control entry, a large entry decoded in a thread, a dictionary not loaded yet).

    A `msgspec.Struct` (compared by identity, like any object): one is built per entry read,
    in half the time of a slotted dataclass or a hand-written ``__init__``.
    """

    shard: int
    token: int
    entry_id: bytes
    fields: dict[bytes, bytes]
    generation: int = 0
    attempt: int = 0
    segment: str | None = None
    delivery_count: int = 1
    env: Envelope | None = None
    event: Any = None
    call: HandlerCall | None = None
    error: DecodeError | None = None


@dataclass(slots=True)
class Tally:
    """What a consumer's handling path did since it started, in entries (events, for a batch
    handler). Also in Prometheus (`eventbus.ops.metrics`), process-wide; these are per consumer."""

    handled: int = 0
    """Handler calls that succeeded."""
    dead_lettered: int = 0
    """Written to the dead-letter stream (failed `max_attempts` times, or undecodable)."""
    duplicates_skipped: int = 0
    """Skipped as already handled by the group (`dedup_window_s`)."""


class Fence(Protocol):
    """The caller's right to handle an entry of a shard."""

    def holds(self, d: Delivery) -> bool:
        """Synchronously: the lease is valid and `d`'s shard is still held by `d`'s lock
        acquisition (and the caller is not stopping)."""
        ...

    async def wait(self, d: Delivery) -> bool:
        """Wait until the lease is valid; False once `d`'s shard is lost (or stopping)."""
        ...


class FailurePolicy(Protocol):
    """What happens to entries that cannot be handled (`Failures`: dead letters, parked
    resources, the operator's control entries; a broadcast consumer's: dropped and logged)."""

    def gives_up(self, parking: bool) -> str:
        """What is done with an entry whose attempts are spent (for the log line)."""
        ...

    async def dead_letter(
        self, d: Delivery, exc: BaseException | None, *, reason: str, fence: Fence
    ) -> Outcome: ...

    async def dead_letter_and_park(
        self, d: Delivery, exc: BaseException, resource_id: str, fence: Fence
    ) -> Outcome: ...

    async def control(self, d: Delivery, fence: Fence, handling: Handling) -> Outcome: ...

    parked: dict[str, str]
    """Resources parked in the shards held (empty most of the time): resource ID -> the ID of
    its first parked dead letter."""

    def is_parked(self, resource_id: str) -> bool: ...

    async def load_parked(self) -> None: ...
