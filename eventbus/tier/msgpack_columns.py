"""MessagePack encoding of whole Arrow columns: per row, the bytes msgspec's encoder writes for
Arrow's Python value of that row, built with Arrow compute kernels instead of a Python object
and an encoder call per row (what rebuilding a typed segment's ``data`` on read costs,
`eventbus.tier.rebuild.restore`).

Only the scalar types whose Python value is a JSON-native one are handled (`encodable`): int64,
float64, bool, string (and dictionary-encoded strings); nulls are ``nil``. The encodings follow
msgspec's (the smallest MessagePack form of an int, a float always as float64, a string's
smallest header), checked byte for byte against msgspec in tests/unit/test_msgpack_columns.py.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

_SEP = pa.scalar(b"", pa.binary())
_NIL = pa.scalar(b"\xc0", pa.binary())
_TRUE = pa.scalar(b"\xc3", pa.binary())
_FALSE = pa.scalar(b"\xc2", pa.binary())
_ENCODE = msgspec.msgpack.Encoder().encode


def const(raw: bytes) -> pa.Scalar:
    """`raw` as a binary scalar (a part of `join` repeated on every row)."""
    return pa.scalar(raw, pa.binary())


def key(name: str) -> bytes:
    """The MessagePack bytes of the string `name` (a map key)."""
    return _ENCODE(name)


def map_header(n: int) -> bytes:
    """The header of a MessagePack map of `n` pairs."""
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def join(parts: list[Any]) -> pa.Array:
    """Rows of the binary arrays and scalars `parts` joined in order (constants merged)."""
    merged: list[Any] = []
    for part in parts:
        if isinstance(part, pa.Scalar) and merged and isinstance(merged[-1], pa.Scalar):
            merged[-1] = const(merged[-1].as_py() + part.as_py())
        else:
            merged.append(part)
    return pc.binary_join_element_wise(*merged, _SEP)


def encodable(kind: pa.DataType) -> bool:
    """Whether `encode` handles a column of type `kind`."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return kind in (pa.int64(), pa.float64(), pa.bool_(), pa.string(), pa.large_string())


def encode(column: Any) -> pa.Array:
    """Each value of `column` (an `encodable` Arrow array or chunked array) as its MessagePack
    bytes (a binary array without nulls: a null is ``nil``). Raises `TypeError` for another
    type."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if pa.types.is_dictionary(kind):
        column, kind = column.dictionary_decode(), kind.value_type
    if kind == pa.int64():
        out = _ints(pc.fill_null(column, 0) if column.null_count else column)
    elif kind == pa.float64():
        filled = pc.fill_null(column, 0.0) if column.null_count else column
        out = join([const(b"\xcb"), _big_endian(filled)])
    elif kind == pa.bool_():
        out = pc.if_else(pc.fill_null(column, False), _TRUE, _FALSE)
    elif kind in (pa.string(), pa.large_string()):
        text = column.cast(pa.binary())
        out = join([_str_headers(pc.binary_length(text)), pc.fill_null(text, b"")])
    else:
        raise TypeError(f"no column encoding for Arrow type {kind}")
    if column.null_count:
        out = pc.if_else(pc.is_valid(column), out, _NIL)
    return out


def _big_endian(values: pa.Array) -> pa.Array:
    """The 8 bytes of each value of a 64-bit array without nulls, most significant first."""
    raw = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(8), len(values), [None, values.buffers()[1]], offset=values.offset
    )
    return pc.binary_reverse(raw.cast(pa.binary()))  # little-endian memory: reversed


def _low(big: pa.Array, width: int) -> pa.Array:
    """The last `width` bytes of each 8-byte big-endian value."""
    return pc.binary_slice(big, 8 - width, 8)


# An int's forms (msgspec's choice: the smallest), by disjoint ranges: (lowest, highest, header,
# width); a header of b"" is a fixint (positive below 128, negative from -32: the low byte).
_INT_FORMS = (
    (-32, 127, b"", 1),
    (128, 255, b"\xcc", 1),
    (256, (1 << 16) - 1, b"\xcd", 2),
    (1 << 16, (1 << 32) - 1, b"\xce", 4),
    (1 << 32, (1 << 63) - 1, b"\xcf", 8),
    (-128, -33, b"\xd0", 1),
    (-(1 << 15), -129, b"\xd1", 2),
    (-(1 << 31), -(1 << 15) - 1, b"\xd2", 4),
    (-(1 << 63), -(1 << 31) - 1, b"\xd3", 8),
)


_SMALL = (-(1 << 15), (1 << 16) - 1)
"""The ints whose encodings `_small_ints` holds (those of most columns: counts, codes, times of
day, small amounts), taken from it by value."""


@functools.cache
def _small_ints() -> pa.Array:
    """msgspec's encoding of every int of `_SMALL` (binary, indexed by value - lowest)."""
    return pa.array([_ENCODE(v) for v in range(_SMALL[0], _SMALL[1] + 1)], pa.binary())


@functools.cache
def _str_header_table() -> pa.Array:
    """msgspec's string header for each byte length below 65,536 (binary, by length): the
    smallest form, fixstr, str8 or str16 (made from the lengths, not by encoding strings of
    each length: 2 GiB of strings made one by one, 0.22 s per process; now 0.016 s)."""
    fix = [bytes([0xA0 | n]) for n in range(32)]
    str8 = [b"\xd9" + bytes([n]) for n in range(32, 256)]
    str16 = [b"\xda" + n.to_bytes(2, "big") for n in range(256, 1 << 16)]
    return pa.array(fix + str8 + str16, pa.binary())


def _ints(values: pa.Array) -> pa.Array:
    """int64 values (no nulls) in their smallest MessagePack forms."""
    if not len(values):
        return pa.array([], pa.binary())
    low, high = (v.as_py() for v in pc.min_max(values).values())
    if _SMALL[0] <= low and high <= _SMALL[1]:
        return _small_ints().take(pc.subtract(values, _SMALL[0]))
    big = _big_endian(values)
    for lo, hi, header, width in _INT_FORMS:  # one form for every row: the common case
        if lo <= low and high <= hi:
            return join([const(header), _low(big, width)]) if header else _low(big, width)
    small = pc.and_(pc.greater_equal(values, _SMALL[0]), pc.less_equal(values, _SMALL[1]))
    large = pc.filter(values, pc.invert(small))
    low, high = (v.as_py() for v in pc.min_max(large).values())
    for lo, hi, header, width in _INT_FORMS:  # the small ones by value, the rest one form
        if lo <= low and high <= hi:
            inside = pc.max_element_wise(pc.min_element_wise(values, _SMALL[1]), _SMALL[0])
            clipped = pc.subtract(inside, _SMALL[0])
            rest = join([const(header), _low(big, width)]) if header else _low(big, width)
            return pc.if_else(small, _small_ints().take(clipped), rest)
    conditions, choices = [], []
    for lo, hi, header, width in _INT_FORMS:
        conditions.append(pc.and_(pc.greater_equal(values, lo), pc.less_equal(values, hi)))
        choices.append(join([const(header), _low(big, width)]) if header else _low(big, width))
    cases = pa.StructArray.from_arrays(conditions, [str(i) for i in range(len(conditions))])
    return pc.case_when(cases, *choices)


def _str_headers(lengths: pa.Array) -> pa.Array:
    """The MessagePack string headers for byte lengths `lengths` (int32 or int64, no nulls
    where it matters: a null length gets a header that `encode` replaces by ``nil``)."""
    n = pc.fill_null(lengths.cast(pa.int64()), 0)
    if not len(n):
        return pa.array([], pa.binary())
    short = _str_header_table().take(pc.min_element_wise(n, (1 << 16) - 1))
    if pc.max(n).as_py() < 1 << 16:
        return short
    long = join([const(b"\xdb"), _low(_big_endian(n), 4)])  # str32 (a value is below 4 GiB)
    return pc.if_else(pc.less(n, 1 << 16), short, long)
