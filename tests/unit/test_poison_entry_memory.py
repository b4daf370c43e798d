"""A poison entry on every path, on fakeredis; see `cases.poison_entry_cases`."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.poison_entry_cases import PoisonEntryCases


class TestPoisonEntryInMemory(MemoryBackend, PoisonEntryCases):
    pass
