"""`ChildrenMetrics`: the ``/metrics`` collector of ``eventbus run --processes N``, reading the
children's multiprocess metric files as prometheus-client's ``MultiProcessCollector`` does, but
skipping a file it cannot read instead of failing the whole scrape.

A child creates each of its metric files (``<type>_<pid>.db`` in ``PROMETHEUS_MULTIPROC_DIR``)
empty and writes its header a moment later; prometheus-client's reader fails on it with
``struct.error`` (a truncated or corrupted file: ``RuntimeError``, ``ValueError``), and
``MultiProcessCollector.collect`` fails with it: the scrape answered 500 with a traceback while a
child was starting. Here that file is left out of that scrape (its values come back at the next
one) and the reason is logged once per file.
"""

from __future__ import annotations

import glob
import logging
import os
import struct
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

UNREADABLE = (struct.error, RuntimeError, ValueError, OSError)
"""What prometheus-client's reader raises on a metric file being created (empty: ``struct.error``),
corrupted (``RuntimeError``: an entry past the used size; ``ValueError``: a key that is not JSON
or UTF-8) or removed (``OSError``)."""


class ChildrenMetrics(MultiProcessCollector):
    """The metrics of the processes writing to the folder `path` (``PROMETHEUS_MULTIPROC_DIR``),
    merged as ``MultiProcessCollector`` merges them (counters and histograms summed, gauges by
    their ``multiprocess_mode``); a file that cannot be read (`UNREADABLE`) is left out of that
    collection and logged at WARNING, once per file name.

    :param registry: registers the collector there (None: not registered)
    :param path: the folder of the ``*.db`` files; `ValueError` if it is not a folder
    """

    def __init__(self, registry: CollectorRegistry | None, path: str) -> None:
        super().__init__(registry, path=path)  # type: ignore[no-untyped-call]
        self._folder = path  # (the base class keeps it in a private attribute)
        self._reported: set[str] = set()  # file names whose skip was logged

    def collect(self) -> Iterable[Metric]:
        """The merged metrics of every readable file (a fresh list of `Metric` per call).

        Through prometheus-client's public ``merge`` only: all files at once, as the library's
        collector does; if that fails, each file alone to find the unreadable ones, then the
        others at once (each file is read twice while a child starts, three times while a
        corrupted file stays). A dead child's live-gauge files, removed by ``eventbus run``'s
        main thread (``mark_process_dead``) during a scrape, are skipped by the library's own
        reader; no other file is removed while the children run."""
        files = sorted(glob.glob(os.path.join(self._folder, "*.db")))
        try:
            return self._merge(files)
        except UNREADABLE:
            pass
        readable = []
        for path in files:
            try:
                self._merge([path])
            except UNREADABLE as exc:
                self._skipped(path, exc)
            else:
                readable.append(path)
        return self._merge(readable)

    @staticmethod
    def _merge(files: list[str]) -> list[Metric]:
        return list(MultiProcessCollector.merge(files, accumulate=True))  # type: ignore[no-untyped-call]

    def _skipped(self, path: str, exc: BaseException) -> None:
        name = os.path.basename(path)
        if name in self._reported:
            return
        self._reported.add(name)
        log.warning(
            "metrics: left out the metric file %s, which could not be read (%s: %s): a child "
            "process creating it (its values are back at the next scrape), or a corrupted file "
            "(left out of every scrape; logged once)",
            name,
            type(exc).__name__,
            exc,
        )
