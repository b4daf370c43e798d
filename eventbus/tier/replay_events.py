"""Typed replay's decoding: archived entries into the pydantic events live consumers get
(`ReplayedEvent`), a batch at a time (`_Decoder`: the envelopes in one MessagePack decode, each
model's payloads in one `TypeAdapter(list[Model])` call), entry by entry (`decode_event`) only
to name the first bad entry. Used by `eventbus.tier.replay.iter_events`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import compress, count, repeat
from operator import is_, itemgetter
from typing import Any

import msgspec
from pydantic import BaseModel, TypeAdapter, ValidationError

from eventbus.errors import DecodeError
from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import FORMAT_MSGPACK, Envelope, _Body, event_type_of
from eventbus.tier.archived import ArchivedEntry
from eventbus.tier.gc_pause import paused_gc

_FIRST = itemgetter(0)


class ReplayedEvent(msgspec.Struct, frozen=True, gc=False):
    """A decoded event and the archived entry it came from (immutable; a `msgspec.Struct`:
    one is built per event replayed)."""

    event: BaseModel
    envelope: Envelope
    entry: ArchivedEntry


def models_by_type(
    models: Iterable[type[BaseModel]] | Mapping[str, type[BaseModel]],
) -> dict[str, type[BaseModel]]:
    """Event type name -> model, named as publishers name them (`event_type_of`)."""
    if isinstance(models, Mapping):
        return dict(models)
    return {event_type_of(m): m for m in models}


def decode_event(entry: ArchivedEntry, models: Mapping[str, type[BaseModel]]) -> ReplayedEvent:
    """Decode `entry` into its model. Raises `DecodeError` naming the segment and entry when the
    envelope is corrupt, the type unknown, or the payload does not validate."""
    env = entry.envelope()
    model = models.get(env.event_type)
    if model is None:
        raise DecodeError(
            f"{entry.segment} entry {entry.entry_id}: no model for event type {env.event_type!r}"
        )
    try:
        return ReplayedEvent(model.model_validate(env.payload), env, entry)
    except ValidationError as exc:
        raise DecodeError(
            f"{entry.segment} entry {entry.entry_id}: payload does not validate as "
            f"{model.__name__}: {exc}"
        ) from None


class _Decoder:
    """Decodes batches of entries into `ReplayedEvent`s: the envelopes of a batch, then the
    payloads of each model in one ``TypeAdapter(list[Model])`` call (entry by entry, with
    `decode_event`, only when that list does not validate: the first bad entry's error)."""

    def __init__(self, models: Mapping[str, type[BaseModel]]) -> None:
        self.models = models
        self.adapters: dict[type[BaseModel], TypeAdapter[Any]] = {}

    def decode(self, batch: list[ArchivedEntry]) -> tuple[list[ReplayedEvent], int]:
        """The events of `batch` in its order up to the first entry that does not decode or
        validate, and that entry's place (``len(batch)`` when there is none): from there on,
        `decode_each` gives the events and raises its `DecodeError`."""
        with paused_gc():  # payload dicts and models: tracked objects, no cycles
            envelopes, events = self._validated(batch)
            ok = next(compress(count(), map(is_, events, repeat(None))), len(events))
            return list(map(ReplayedEvent, events[:ok], envelopes[:ok], batch[:ok])), ok

    def _validated(self, batch: list[ArchivedEntry]) -> tuple[list[Envelope], list[Any]]:
        """The envelopes of `batch` up to the first that does not decode, and their events
        (None where the list of its model did not validate, or from an unknown type on)."""
        envelopes = _envelopes_at_once(batch)
        if envelopes is None:
            envelopes = []
            for entry in batch:
                try:
                    envelopes.append(entry.envelope())
                except DecodeError:
                    break  # its error comes in its turn (`decode_each`)
        events: list[Any] = [None] * len(envelopes)
        groups: dict[type[BaseModel], list[int]] = {}
        models = self.models
        for i, env in enumerate(envelopes):
            model = models.get(env.event_type)
            if model is None:
                break  # its error comes in its turn
            groups.setdefault(model, []).append(i)
        for model, idx in groups.items():
            adapter = self.adapters.get(model)
            if adapter is None:
                adapter = self.adapters[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
            try:
                valid = adapter.validate_python([envelopes[i].payload for i in idx])
            except Exception:  # (a validator may raise anything): each entry on its own
                continue  # in its turn, its error (or exception) in entry order
            for i, event in zip(idx, valid, strict=True):
                events[i] = event
        return envelopes, events

    def decode_each(self, entries: list[ArchivedEntry]) -> Iterator[ReplayedEvent]:
        """`decode_event` on each of `entries`: the path of a batch holding a bad entry."""
        for entry in entries:
            yield decode_event(entry, self.models)


_BODIES = msgspec.msgpack.Decoder(list[_Body])
_ARRAY32 = b"\xdd"


def _envelopes_at_once(batch: list[ArchivedEntry]) -> list[Envelope] | None:
    """The envelopes of `batch` from one MessagePack decode of all their bodies (an array's
    elements are its values' encodings one after another: the bodies joined under an array
    header), the same as `ArchivedEntry.envelope` gives each. None, for the entry by entry
    path, unless every entry is of the short plain form `decode_entry` decodes in one typed
    pass and decoded when it was archived (its envelope columns are set), and the array
    decodes with each body's time where the archive has it (no body took another's bytes)."""
    datas = [e.data for e in batch]
    sizes = list(map(len, datas))
    if (
        not datas
        or min(sizes) == 0
        or max(sizes) > MIN_CONTAINERS
        or set(map(_FIRST, datas)) != {FORMAT_MSGPACK}
        or None in [e.event_id for e in batch]
    ):
        return None
    joined = b"".join([_ARRAY32, len(datas).to_bytes(4, "big"), *(d[1:] for d in datas)])
    try:
        bodies = _BODIES.decode(joined)
    except Exception:  # (any failure: entry by entry, each with its own error)
        return None
    if [b.ts for b in bodies] != [e.published_at_ms for e in batch]:
        return None
    return list(
        map(
            Envelope,
            [e.resource_id for e in batch],
            [e.event_type for e in batch],
            [b.id for b in bodies],
            [b.ts for b in bodies],
            [b.h for b in bodies],
            [b.p for b in bodies],
        )
    )
