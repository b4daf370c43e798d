"""The batch handler cases (`cases.batch_cases`) on the in-memory bus."""

from __future__ import annotations

from cases.backends import MemoryBackend
from cases.batch_cases import BatchCases


class TestBatchInMemory(MemoryBackend, BatchCases):
    pass
