"""`unpack_body`'s clean-up of a refused body: its containers are freed by our own code, a
`FREE_SLICE` at a time (fbb345c), not by msgpack's C clean-up all at once with the GIL held.

Observed without timing: the containers are `ExtType` objects of a class that notes when each
is freed, and `FREE_SLICE` is an int that notes each slice it is read for (``del
built[-FREE_SLICE:]`` negates it once per slice)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from eventbus.errors import DecodeError
from eventbus.protocol import budget
from eventbus.protocol.budget import unpack_body

_EXT = msgpack.ExtType  # the real one: bodies are packed with it, while the test's is patched
SLICE = 10
CONTAINERS = 35
"""The budget (`max_containers`): containers built before the body is refused."""


class _Frees:
    def __init__(self) -> None:
        self.freed = 0  # containers freed so far
        self.before_each_slice: list[int] = []  # `freed` when each slice began


class _Slice(int):
    """`FREE_SLICE`, noting how many containers were freed before each slice."""

    frees: _Frees

    def __neg__(self) -> int:
        self.frees.before_each_slice.append(self.frees.freed)
        return -int(self)


@pytest.fixture
def frees(monkeypatch: pytest.MonkeyPatch) -> _Frees:
    frees = _Frees()

    class Tracked(_EXT):  # type: ignore[misc]
        """An ext container that counts its own freeing."""

        def __del__(self) -> None:
            frees.freed += 1

    free_slice = _Slice(SLICE)
    free_slice.frees = frees
    monkeypatch.setattr(budget, "FREE_SLICE", free_slice, raising=False)  # (none before fbb345c)
    monkeypatch.setattr(msgpack, "ExtType", Tracked)  # what budget's ext hook builds
    return frees


def _exts(n: int) -> bytes:
    """A body: an array of `n` one-byte extensions (3 bytes each: one container each)."""
    packed: bytes = msgpack.packb([_EXT(1, b"x") for _ in range(n)])
    return packed


def test_a_refused_body_is_freed_a_slice_at_a_time(frees: _Frees) -> None:
    with pytest.raises(DecodeError, match="decompression bomb"):
        unpack_body(_exts(CONTAINERS + 5), max_containers=CONTAINERS)
    # the CONTAINERS kept are freed by the slices: none before the first one (msgpack's own
    # clean-up freed none of them), then SLICE per slice, the last one the rest; the one past
    # the budget (never kept) goes after them, with the error its hook raised
    assert frees.before_each_slice == [0, 10, 20, 30]
    assert frees.freed == CONTAINERS + 1


def test_a_corrupt_body_is_freed_a_slice_at_a_time(frees: _Frees) -> None:
    # the array claims one more element than the body holds: msgpack fails at its end
    body = _exts(CONTAINERS - 10)
    corrupt = b"\xdc" + (CONTAINERS - 9).to_bytes(2, "big") + body[3:]  # array 16, n+1
    with pytest.raises(DecodeError, match="corrupt envelope"):
        unpack_body(corrupt, max_containers=CONTAINERS)
    assert frees.freed == CONTAINERS - 10
    assert frees.before_each_slice == [0, 10, 20]


def test_an_accepted_body_keeps_its_containers(frees: _Frees) -> None:
    value: Any = unpack_body(_exts(CONTAINERS - 1), max_containers=CONTAINERS)
    # our references dropped a slice at a time; the value's own references keep them all
    assert len(value) == CONTAINERS - 1
    assert frees.freed == 0
    assert frees.before_each_slice == [0, 0, 0, 0]
    del value
    assert frees.freed == CONTAINERS - 1
