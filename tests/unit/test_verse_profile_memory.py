"""The Verse profile's publisher and consumer on fakeredis; see `cases.verse_profile_cases`."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.verse_profile_cases import VerseProfileCases


class TestVerseProfileInMemory(MemoryBackend, VerseProfileCases):
    pass
