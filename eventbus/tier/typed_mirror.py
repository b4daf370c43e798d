"""Simple pydantic models, found once per model for the typed columns' fast paths: their
msgspec mirrors (`mirror_struct`: decoding a payload into one validates it as the model would,
so that the offloader decodes and validates a page's payloads in one pass,
`eventbus.tier.segment_bodies`, `eventbus.tier.typed.TypedPayloads.mirrors`), and whether a
model's fields are all scalars Arrow converts as validated (`_flat`).
"""

from __future__ import annotations

import datetime as dt
import types
import typing
from typing import Any

import msgspec
from pydantic import BaseModel, RootModel
from pydantic_core import PydanticUndefined

_MIRRORED = (int, float, str, bool)
_LAX_CONFIG = (
    *("strict", "str_strip_whitespace", "str_to_lower", "str_to_upper", "str_min_length"),
    *("str_max_length", "coerce_numbers_to_str", "validate_default"),
)


def mirror_struct(model: type[BaseModel]) -> type[msgspec.Struct] | None:
    """A msgspec Struct of `model`'s fields (same names, order and defaults) when `model` is
    simple enough that decoding a payload into it validates exactly as `model` would and gives
    the same values, else None: every field ``int``, ``float``, ``str`` or ``bool``, or that or
    None, without constraints, aliases or default factories; no validators, no post-init, no
    configuration that changes validation (strict, string transforms, ``extra="forbid"``, no
    inf/nan). msgspec's checks are then a subset of pydantic's lax ones with the same result
    (an int given for a float becomes a float in both); a payload msgspec refuses is validated
    by pydantic (it may still be valid: ``"1"`` for an int). Used by the offloader to decode
    and validate the payloads of a page in one pass (`eventbus.tier.segment_bodies`)."""
    if issubclass(model, RootModel) or getattr(model, "__pydantic_post_init__", None):
        return None
    d = model.__pydantic_decorators__
    if d.validators or d.field_validators or d.root_validators or d.model_validators:
        return None
    if any("__get_pydantic_core_schema__" in vars(c) for c in model.__mro__ if c not in _BASES):
        return None
    config = model.model_config
    if any(config.get(k) for k in _LAX_CONFIG) or config.get("extra") == "forbid":
        return None
    if config.get("allow_inf_nan") is False:
        return None
    fields: list[tuple[str, Any, Any]] = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1
        base = args[0] if optional else ann
        if base not in _MIRRORED or f.metadata or f.alias is not None:
            return None
        if f.validation_alias is not None or f.default_factory is not None:
            return None
        if f.default is PydanticUndefined:
            fields.append((name, base | None if optional else base, msgspec.NODEFAULT))
        elif f.default is None or type(f.default) in _MIRRORED:
            fields.append((name, base | None if optional else base, f.default))
        else:
            return None
    spec = [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields]
    try:
        return msgspec.defstruct(model.__name__, spec, kw_only=True, gc=False)
    except (TypeError, ValueError):  # a field name msgspec refuses
        return None


_BASES = frozenset({BaseModel, object})


_FLAT = (str, int, float, bool, bytes, dt.datetime, dt.date)


def _flat(model: type[BaseModel]) -> bool:
    """Whether every field of `model` is a scalar (or an optional one) that Arrow converts as
    validated: ``str``, ``int``, ``float``, ``bool``, ``bytes``, ``datetime``, ``date`` (not a
    subclass such as an enum)."""
    for field in model.model_fields.values():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        if ann not in _FLAT:
            return False
    return True
