"""`eventbus.tier.msgpack_columns`: a column's MessagePack bytes are msgspec's for each value."""

from __future__ import annotations

from typing import Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventbus.tier.msgpack_columns import encodable, encode

_encode = msgspec.msgpack.Encoder().encode

_INT_EDGES = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33]
_INT_EDGES += [-128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
_ints = st.sampled_from(_INT_EDGES) | st.integers(-(2**63), 2**63 - 1) | st.integers(-300, 300)
_texts = st.text(max_size=40) | st.sampled_from(["é" * 16, "a" * 31, "a" * 32, "a" * 255])
_texts |= st.sampled_from(["b" * 256, "c" * 65535, "d" * 65536])
_floats = st.floats() | st.sampled_from([0.0, -0.0, 1e300, float("inf")])

_COLUMNS = [
    (pa.int64(), _ints),
    (pa.float64(), _floats),
    (pa.bool_(), st.booleans()),
    (pa.string(), _texts),
    (pa.large_string(), _texts),
]


@pytest.mark.parametrize(("kind", "values"), _COLUMNS, ids=lambda c: str(c))
@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_each_value_is_encoded_as_msgspec_encodes_it(
    kind: pa.DataType, values: Any, data: st.DataObject
) -> None:
    rows = data.draw(st.lists(st.none() | values, max_size=40))
    column = pa.array(rows, kind)
    assert encodable(kind)
    assert encode(column).to_pylist() == [_encode(v) for v in rows]
    if len(rows) > 2:  # a slice (an offset into the buffers) and a chunked column
        assert encode(column.slice(1, len(rows) - 2)).to_pylist() == [
            _encode(v) for v in rows[1:-1]
        ]
        chunked = pa.chunked_array([column.slice(0, 1), column.slice(1)])
        assert encode(chunked).to_pylist() == [_encode(v) for v in rows]


def test_dictionary_encoded_strings_are_encoded_as_their_values() -> None:
    rows = ["JFK", "LGA", None, "JFK"]
    column = pa.array(rows).dictionary_encode()
    assert encodable(column.type)
    assert encode(column).to_pylist() == [_encode(v) for v in rows]


def test_other_types_are_refused() -> None:
    column = pa.array([[1]], pa.list_(pa.int64()))
    assert not encodable(column.type)
    with pytest.raises(TypeError, match="no column encoding"):
        encode(column)


def test_string_headers_are_msgspecs_for_lengths_across_every_form() -> None:
    """The header table (fixstr, str8, str16 by length) against msgspec for a spread of
    lengths, multi-byte characters included (the header counts bytes)."""
    lengths = [*range(0, 300), *range(65_400, 65_540), *range(1_000, 65_000, 997)]
    rows = ["é" * (n // 2) + "x" * (n % 2) for n in lengths]
    assert encode(pa.array(rows, pa.string())).to_pylist() == [_encode(v) for v in rows]
