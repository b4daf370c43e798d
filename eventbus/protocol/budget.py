"""The structural budget of an envelope's MessagePack body: how many containers it may hold.

MessagePack spends one byte on an empty array or map, which Python turns into a ~60-byte object:
a 2 KB zstd frame of 64 MB of empty arrays would become gigabytes of lists. So a body may hold
at most one container (array, map or extension) per `CONTAINER_BYTES` of its decompressed size
(at least `MIN_CONTAINERS`, at most `max_containers`: `eventbus.protocol.codec.decode_entry`
passes ``max_bytes // DECOMPRESSION_FACTOR``), and no string, array or map header may claim
more elements than the body has bytes. Past the budget, decoding stops with `DecodeError`,
having allocated at most about 160 bytes per container allowed (8 of them for the list that
lets a refused body be freed a slice at a time, off the event loop's way).
"""

from __future__ import annotations

from typing import Any

import msgpack

from eventbus.errors import DecodeError

CONTAINER_BYTES = 8
"""A body may hold one container (array, map, extension) per this many decompressed bytes."""
MIN_CONTAINERS = 4096
"""Containers always allowed, whatever the body's size: no body under 4 KiB is refused for its
structure (a container takes at least one byte)."""


FREE_SLICE = 65_536
"""Containers of a refused body freed at a time (a few milliseconds with the GIL held)."""


class _OverBudget(Exception):
    pass


def unpack_body(body: bytes, *, max_containers: int) -> Any:
    """Unpack a MessagePack body under the structural budget (module docstring). Raises
    `DecodeError` when it is corrupt or holds more containers than allowed."""
    budget = min(max(MIN_CONTAINERS, len(body) // CONTAINER_BYTES), max(1, max_containers))
    # every element takes at least one byte (a pair two), so no header may claim more
    longest = len(body)
    if budget >= longest:  # a container takes a byte: this body cannot exceed the budget
        try:
            return msgpack.unpackb(
                body,
                raw=False,
                strict_map_key=True,
                max_str_len=longest,
                max_bin_len=longest,
                max_array_len=longest,
                max_map_len=longest // 2,
                max_ext_len=longest,
            )
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None
    left = budget
    # every container built, also referenced here: when decoding stops (the budget ran out, or
    # a corrupt byte), msgpack's own clean-up (one C call, holding the GIL) then frees none of
    # them, and `finally` frees them a slice at a time, so that the event loop's thread gets
    # the GIL in between (freeing millions of containers at once stopped it for 2 s and more
    # under CPU load, past the lease: tests/integration/test_consumer_safety.py's bomb)
    built: list[Any] = []

    def count(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise _OverBudget
        built.append(obj)
        return obj

    def ext(code: int, data: bytes) -> Any:
        return count(msgpack.ExtType(code, data))

    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            list_hook=count,
            object_hook=count,
            ext_hook=ext,
            max_str_len=len(body),
            max_bin_len=len(body),
            max_array_len=longest,
            max_map_len=longest // 2,
            max_ext_len=len(body),
        )
    except _OverBudget:
        raise DecodeError(
            f"envelope holds more than {budget} arrays/maps in {len(body)} bytes (at most one "
            f"per {CONTAINER_BYTES} bytes, {max_containers} in all): refused as a "
            "decompression bomb"
        ) from None
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None
    finally:
        while built:
            del built[-FREE_SLICE:]
