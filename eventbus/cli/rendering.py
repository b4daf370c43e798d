"""Entries as the commands print them (``eventbus tail``, ``eventbus dlq show``): JSON text of
what another client wrote, whatever it is.

A decoded payload can be a value JSON has no text for: bytes and MessagePack extension types
(written by `str`), maps keyed by bytes, or values nested deeper than json's encoder goes
(``RecursionError`` near 1,000 levels, which a 1 KB entry can be). Printing one must not end
the command with a traceback and hide the entries after it (tests/unit/test_decoders_fuzz.py).
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 100
"""Levels of a value printed when JSON cannot print it whole; deeper ones are elided."""


def json_text(value: Any, *, indent: int | None = None) -> str:
    """`value` as JSON text (ASCII: control characters escaped; bytes, extension types and
    other values JSON has no form for as their `str`). When JSON cannot write it (a map with
    keys that are not text nor numbers, nesting deeper than the encoder goes), keys are
    written as their `str` and what lies deeper than `MAX_DEPTH` levels as a note saying so.
    Raises nothing."""
    try:
        return json.dumps(value, indent=indent, default=str)
    except (RecursionError, TypeError, ValueError):
        return json.dumps(_printable(value, 0), indent=indent, default=str)


def _printable(value: Any, depth: int) -> Any:
    if isinstance(value, dict | list | tuple) and depth >= MAX_DEPTH:
        return f"<{type(value).__name__} nested deeper than {MAX_DEPTH} levels: not shown>"
    if isinstance(value, dict):
        return {_key(k): _printable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v, depth + 1) for v in value]
    return value


def _key(key: Any) -> Any:
    return key if key is None or isinstance(key, str | int | float | bool) else str(key)
