"""The envelope bodies of a page of entries decoded in one pass, for the segment writer
(`eventbus.tier.segment_columns.entry_columns`): the envelope's own fields checked as
`eventbus.protocol.codec` does, the payload left as bytes (untyped) or decoded into the
model's msgspec mirror (`eventbus.tier.typed.mirror_struct`: validated in the same pass).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import msgspec

from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import _BODY, FORMAT_MSGPACK
from eventbus.tier.typed import TypedPayloads


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


class _Head(msgspec.Struct, gc=False):
    """`eventbus.protocol.codec._Body` with the payload left as its MessagePack bytes: the
    same checks of the envelope's own fields, the payload's structure walked but not built (an
    untyped segment needs no payload objects; its strings are not decoded)."""

    v: Literal[1]
    id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    ts: int
    h: dict[str, str]
    p: msgspec.Raw


_DECODE_HEAD = msgspec.msgpack.Decoder(_Head).decode
_DECODE_BODY = _BODY.decode


def _decode_all(
    rids: list[Any], types: list[Any], datas: list[Any], typed: TypedPayloads | None
) -> list[Any] | None:
    """The envelope bodies of all entries in one pass (with `typed`, their payloads decoded,
    into the model's msgspec mirror where the page has one model that has one
    (`TypedPayloads.mirrors`): validated in the same pass; else as raw bytes), when every entry
    is the common case `decode_entry` decodes in one typed pass (``rid`` and ``type`` present,
    format ``0x01``, at most `MIN_CONTAINERS` bytes); None when any entry is not (or does not
    decode): then each goes through `decode_entry`."""
    if None in rids or None in types or None in datas:
        return None
    if {d[:1] for d in datas} != {_PLAIN} or max(map(len, datas)) > MIN_CONTAINERS:
        return None
    mirrored = None if typed is None else _mirror_decoder(typed, types)
    decode = _DECODE_HEAD if typed is None else (mirrored or _DECODE_BODY)
    try:
        return [decode(d[1:]) for d in datas]
    # a payload string that is not UTF-8, or nesting past msgspec's depth (a poison entry):
    # each entry then goes through `decode_entry`, which makes either its own DecodeError
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        if mirrored is None:
            return None
    try:  # some payload is not the mirror's (pydantic validates it): entry by entry
        return [_decode_either(mirrored, d[1:]) for d in datas]
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return None


def _decode_either(mirrored: Any, body: bytes) -> Any:
    try:
        return mirrored(body)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return _DECODE_BODY(body)


def _mirror_decoder(typed: TypedPayloads, types: list[bytes]) -> Any:
    """The decoder of bodies whose payload is the mirror of the one model of every entry of
    `types` (None: the entries have several models, or theirs has no mirror)."""
    if typed.any_type:
        key = None
    else:
        kinds = set(types)
        if len(kinds) != 1:
            return None
        key = _text(kinds.pop())
        if key not in typed.models:
            return None
    mirror = typed.mirrors[key]
    return None if mirror is None else _mirrored_body(mirror)


@functools.lru_cache(maxsize=64)
def _mirrored_body(mirror: type[msgspec.Struct]) -> Any:
    """`codec._Body`'s decoder with the payload typed as `mirror`."""
    body = msgspec.defstruct(
        "Body",
        [
            ("v", Literal[1]),
            ("id", Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]),
            ("ts", int),
            ("h", dict[str, str]),
            ("p", mirror),
        ],
        gc=False,
    )
    return msgspec.msgpack.Decoder(body).decode


_PLAIN = bytes([FORMAT_MSGPACK])
