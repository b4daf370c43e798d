"""A poison entry on every path, on redis-server; see `cases.poison_entry_cases`."""

from __future__ import annotations

from cases.backends import RedisBackend
from cases.poison_entry_cases import PoisonEntryCases


class TestPoisonEntryOnRedis(RedisBackend, PoisonEntryCases):
    pass
