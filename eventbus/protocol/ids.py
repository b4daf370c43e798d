"""Stream entry IDs (``<ms>-<seq>``) as integer pairs, and their fixed-width form in object keys.

Redis entry IDs are two unsigned 64-bit integers: the millisecond time at which Redis accepted
the entry, and a sequence number within that millisecond. They compare as integer pairs, not as
strings (``"9-0" < "10-0"`` is false as text). Object keys need an order that *text* sorting
(which every object store listing and `ls` use) gets right, so keys carry each part zero-padded to
20 digits, the width of the largest 64-bit value: ``00000001732147200000-00000000000000000003``.
"""

from __future__ import annotations

from typing import NamedTuple

from eventbus.errors import ConfigError

_MAX = (1 << 64) - 1
PAD = 20  # digits of 2**64 - 1


class EntryId(NamedTuple):
    """An entry ID; tuples compare in stream order. ``str()`` gives Redis's ``<ms>-<seq>``."""

    ms: int
    seq: int

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"

    @property
    def padded(self) -> str:
        """Fixed-width form for object keys: both parts zero-padded to 20 digits."""
        return f"{self.ms:0{PAD}d}-{self.seq:0{PAD}d}"

    def next(self) -> EntryId:
        """The smallest ID after this one (for exclusive lower bounds)."""
        if self.seq < _MAX:
            return EntryId(self.ms, self.seq + 1)
        return EntryId(self.ms + 1, 0)

    def prev(self) -> EntryId:
        """The largest ID before this one (``0-0`` has none: raises `ConfigError`)."""
        if self.seq > 0:
            return EntryId(self.ms, self.seq - 1)
        if self.ms == 0:
            raise ConfigError("entry ID 0-0 has no predecessor")
        return EntryId(self.ms - 1, _MAX)


ZERO = EntryId(0, 0)


def parse_id(value: str | bytes | EntryId) -> EntryId:
    """Parse ``"<ms>-<seq>"`` (text, bytes, or the padded key form); a bare ``"<ms>"`` means
    ``<ms>-0``. Raises `ConfigError` naming the value when it is not an entry ID."""
    if isinstance(value, EntryId):
        return value
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    try:
        result = EntryId(int(ms), int(seq) if seq else 0)
    except ValueError:
        raise ConfigError(f"not a stream entry ID: {text!r}") from None
    if not (0 <= result.ms <= _MAX and 0 <= result.seq <= _MAX):
        raise ConfigError(f"stream entry ID out of range: {text!r}")
    return result
