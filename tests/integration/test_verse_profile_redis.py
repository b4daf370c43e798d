"""The Verse profile's publisher and consumer on redis-server; see
`cases.verse_profile_cases`. The mixed fleet is `test_verse_fleet.py`."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.verse_profile_cases import VerseProfileCases


class TestVerseProfileOnRedis(RedisBackend, VerseProfileCases):
    pass
