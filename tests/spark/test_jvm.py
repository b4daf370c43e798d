"""`eventbus.spark.jvm.parquet_select` when a PySpark upgrade has moved an internal its fast
route uses: the native read still builds Spark's Parquet DataFrame (through the public API),
with the fast route's rows, says which piece is missing once, probes it once per session, and
still raises the read's own errors.

Each upgrade is simulated on the real local session by hiding ONE internal from eventbus only
(PySpark's own public API keeps its internals): ``spark._jvm`` removed, the import of
``pyspark.sql.classic.dataframe`` failing for `eventbus.spark.jvm`, or ``spark._jvm`` replaced by
`Relocated`, which looks a Java name up under another name in the real JVM, so that py4j raises
what it raises for a class or method that is not there."""

from __future__ import annotations

import builtins
import functools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import AnalysisException
from spark_support import Tick, offload, publish, ticks

import eventbus.spark.jvm as jvm
from eventbus.spark import read

pytestmark = pytest.mark.integration

ROUND_TRIPS = "about one Py4J round trip per segment path and per column"


class Relocated:
    """A session's ``_jvm`` after an upgrade that moved the dotted Java names of `moved`: each
    is looked up as its value in the real JVM (py4j's own answer for a name that is not
    there); every other name as before. `lookups` records the names looked up through it."""

    def __init__(self, real: Any, moved: dict[str, str], path: str = "") -> None:
        self._real, self._moved, self._path = real, moved, path
        self.lookups: list[str] = []

    def __getattr__(self, name: str) -> Any:
        path = f"{self._path}.{name}" if self._path else name
        self.lookups.append(path)
        if path in self._moved:
            return _lookup(self._real, self._moved[path])
        if any(m.startswith(path + ".") for m in self._moved):
            deeper = Relocated(self._real, self._moved, path)
            deeper.lookups = self.lookups
            return deeper
        return _lookup(self._real, path)


def _lookup(jvm: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), jvm)


def no_jvm(spark: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delattr(spark, "_jvm")  # PySpark's reader uses the SparkContext's
    return "SparkSession._jvm"


def no_classic_dataframe(spark: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """The module moved, as `eventbus.spark.jvm` sees it (PySpark's own imports still work)."""
    real = builtins.__import__

    def guarded(name: str, globals: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (
            name == "pyspark.sql.classic.dataframe"
            and (globals or {}).get("__name__") == jvm.__name__
        ):
            raise ImportError(f"No module named {name!r}")
        return real(name, globals, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)
    return "pyspark.sql.classic.dataframe.DataFrame"


def relocated(moved: dict[str, str], piece: str) -> Callable[[Any, pytest.MonkeyPatch], str]:
    def apply(spark: Any, monkeypatch: pytest.MonkeyPatch) -> str:
        monkeypatch.setattr(spark, "_jvm", Relocated(spark._jvm, moved))
        return piece

    return apply


# py4j: an unknown class is a JavaPackage, calling it a TypeError ("'JavaPackage' object is
# not callable"); an unknown static method a Py4JError ("... does not exist in the JVM"); a
# method given an argument of another type a Py4JError ("Method parquet([...]) does not exist")
JACKSON_GONE = relocated(
    {"com.fasterxml.jackson.databind.ObjectMapper": "com.fasterxml.jackson.databind.Gone"},
    "Jackson's com.fasterxml.jackson.databind.ObjectMapper on Spark's class path",
)
TO_SEQ_GONE = relocated(
    {"org.apache.spark.api.python.PythonUtils": "java.lang.Object"},
    "org.apache.spark.api.python.PythonUtils.toSeq",
)
TO_SEQ_CHANGED = relocated(  # found, but gives a java.util.List: the reader's call fails
    {"org.apache.spark.api.python.PythonUtils.toSeq": "java.util.Collections.unmodifiableList"},
    "the JVM DataFrameReader's schema(StructType).parquet(Seq)",
)
UPGRADES = {
    "no _jvm": no_jvm,
    "no classic DataFrame": no_classic_dataframe,
    "Jackson gone": JACKSON_GONE,
    "toSeq gone": TO_SEQ_GONE,
    "toSeq changed": TO_SEQ_CHANGED,
}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No session's internals probed yet, no frame kept, nothing said yet (restored after the
    test)."""
    monkeypatch.setattr(jvm, "_TOOLS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(jvm, "_KEPT_FRAMES", weakref.WeakKeyDictionary())
    monkeypatch.setattr(jvm, "_SAID", set(), raising=False)


def rows(df: Any) -> list[dict[str, Any]]:
    got = [r.asDict(recursive=True) for r in df.collect()]
    return sorted(got, key=lambda r: (r["shard"], r["entry_ms"], r["entry_seq"]))


def archived(redis_db: str, tmp_path: Path, topic: str) -> tuple[dict[str, Any], list[Path]]:
    """200 ticks archived as typed segments (nothing left in Redis): a typed read's options
    (the archive alone) and the segment files."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(200))
    offload(redis_db, store, topic, typed_models={topic: "spark_support:Tick"})
    segments = list(Path(store).glob(f"{topic}/*/*.parquet"))
    assert len(segments) > 1
    return {"store": store, "topic": topic, "model": Tick}, segments


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "eventbus.spark"]


@pytest.mark.parametrize("upgrade", UPGRADES.values(), ids=UPGRADES.keys())
def test_a_moved_internal_still_reads_natively_with_the_fast_routes_rows(
    spark: Any,
    redis_db: str,
    tmp_path: Path,
    topic: str,
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    upgrade: Callable[[Any, pytest.MonkeyPatch], str],
) -> None:
    """With one internal missing or changed, `read` still gives a DataFrame of Spark's Parquet
    reader over the segment files (not the Python source, nor its misleading "Spark cannot
    read <store>"), with the fast route's rows and schema, and names the missing piece."""
    options, segments = archived(redis_db, tmp_path, topic)
    fast = read(spark, options)
    assert isinstance(jvm._TOOLS[spark], jvm._Tools)  # the intact session took the fast route
    want = rows(fast)
    assert len(want) == 200
    monkeypatch.setattr(jvm, "_TOOLS", weakref.WeakKeyDictionary())  # a session not seen yet
    monkeypatch.setattr(jvm, "_KEPT_FRAMES", weakref.WeakKeyDictionary())  # nothing kept
    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, "eventbus.spark"):
        piece = upgrade(spark, patched)
        df = read(spark, options)
    assert len(said(caplog)) == 1
    assert piece in said(caplog)[0] and ROUND_TRIPS in said(caplog)[0]
    if upgrade is TO_SEQ_CHANGED:  # the Java line that says what moved, not py4j's preamble
        assert "does not exist" in said(caplog)[0]
    assert len(df.inputFiles()) == len(segments)
    assert df.schema == fast.schema
    assert rows(df) == want


def test_a_moved_internal_is_probed_once_per_session_and_said_once(
    spark: Any,
    redis_db: str,
    tmp_path: Path,
    topic: str,
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two reads with Jackson gone: one warning, and the second read does not look the
    internals up again (the session remembers its route); both give the same rows."""
    options, segments = archived(redis_db, tmp_path, topic)
    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, "eventbus.spark"):
        JACKSON_GONE(spark, patched)
        moved = spark._jvm
        first = read(spark, options)
        probed = list(moved.lookups)
        again = read(spark, options)
    assert probed and moved.lookups == probed  # nothing looked up by the second read
    assert len(said(caplog)) == 1
    assert "ObjectMapper" in said(caplog)[0] and ROUND_TRIPS in said(caplog)[0]
    assert "ObjectMapper" in jvm._TOOLS[spark]  # the session's route: the public API
    assert len(first.inputFiles()) == len(again.inputFiles()) == len(segments)
    assert rows(first) == rows(again)


def test_errors_of_the_read_itself_still_raise(
    spark: Any,
    redis_db: str,
    tmp_path: Path,
    topic: str,
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An expression naming no column, or a path Spark cannot list, raises Spark's
    `AnalysisException` whichever route builds the frame (the intact fast route, toSeq gone:
    found missing when the session is probed, toSeq changed: found while the relation is
    built), and an intact session keeps its fast route after them; a good read then works."""
    _, segments = archived(redis_db, tmp_path, topic)
    paths = sorted(f"file://{p.resolve()}" for p in segments)  # (as_uri: shard%3D0)
    schema = spark.read.parquet(*paths).schema
    for upgrade in (None, TO_SEQ_GONE, TO_SEQ_CHANGED):
        with monkeypatch.context() as patched:
            patched.setattr(jvm, "_TOOLS", weakref.WeakKeyDictionary())
            if upgrade is not None:
                upgrade(spark, patched)
            with pytest.raises(AnalysisException, match="no_such_column"):
                jvm.parquet_select(spark, schema, paths, ["resource_id", "no_such_column + 1"])
            with pytest.raises(AnalysisException, match="PATH_NOT_FOUND"):
                gone = f"{paths[0]}.gone"
                jvm.parquet_select(spark, schema, [*paths, gone], ["resource_id"])
            df = jvm.parquet_select(spark, schema, paths, ["resource_id"])
            assert df.count() == 200
            route = jvm._TOOLS[spark]
            assert isinstance(route, jvm._Tools) if upgrade is None else isinstance(route, str)


def test_a_query_context_error_leaves_pytests_log_capture_as_it_was(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PySpark logs an analysis error with a query context through a non-propagating
    `PySparkLogger`, to which pytest attaches its capture handler at each test phase: the
    handler keeps pytest's formatter (tests/spark/conftest.py), so that later tests' records
    are still formatted by pytest (with ``record.message``)."""
    before = caplog.handler.formatter
    with pytest.raises(AnalysisException, match="no_such_column"):
        spark.range(1).selectExpr("no_such_column + 1")
    context_logger = logging.getLogger("SQLQueryContextLogger")
    assert not context_logger.propagate  # the logger pytest attaches its handlers to
    context_logger.addHandler(caplog.handler)  # what pytest does at the next test phase
    try:
        assert caplog.handler.formatter is before
    finally:
        context_logger.removeHandler(caplog.handler)
    logging.getLogger("eventbus.spark").warning("after %s", "it")
    assert [r.message for r in caplog.records if r.name == "eventbus.spark"] == ["after it"]


def test_bad_input_raises_and_keeps_the_fast_route(
    spark: Any,
    redis_db: str,
    tmp_path: Path,
    topic: str,
    fresh: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A path that is not text is the caller's error: it raises `TypeError`, the session keeps
    its fast route and nothing is said (before 29c4412 the route was given up for the session,
    with a warning naming an internal that had not moved)."""
    options, segments = archived(redis_db, tmp_path, topic)
    schema = spark.read.parquet(*[f"file://{p.resolve()}" for p in segments]).schema
    with caplog.at_level(logging.WARNING, "eventbus.spark"):
        with pytest.raises(TypeError):
            jvm.parquet_select(spark, schema, [Path(p) for p in segments], ["resource_id"])
        assert isinstance(jvm._TOOLS[spark], jvm._Tools)
        assert len(rows(read(spark, options))) == 200
    assert said(caplog) == []


def test_only_py4j_answers_for_a_missing_name_count_as_a_moved_internal() -> None:
    """A stopped session's object, a failed authentication or a Java exception are not a moved
    internal: taking them for one would send the session's reads to the slow route for good."""
    from py4j.protocol import Py4JAuthenticationError, Py4JError, Py4JNetworkError

    moved = [
        AttributeError("'SparkSession' object has no attribute '_jvm'"),
        ImportError("No module named 'pyspark.sql.classic.dataframe'"),
        TypeError("'JavaPackage' object is not callable"),
        Py4JError(
            "An error occurred while calling o57.parquet. Trace:\n"
            "py4j.Py4JException: Method parquet([class java.util.ArrayList]) does not exist"
        ),
        Py4JError("org.apache.spark.api.python.PythonUtils.toSeq does not exist in the JVM"),
        Py4JError("Trying to call a package."),
    ]
    not_moved = [
        Py4JError(
            "An error occurred while calling o12.read. Trace:\n"
            "py4j.Py4JException: Target Object ID does not exist for this gateway :o12"
        ),
        Py4JAuthenticationError("Authentication error: unexpected response"),
        Py4JNetworkError("Answer from Java side is empty"),
        ValueError("something else"),
    ]
    assert [jvm._is_moved(e) for e in moved] == [True] * len(moved)
    assert [jvm._is_moved(e) for e in not_moved] == [False] * len(not_moved)
    assert "does not exist" in jvm._first_line(moved[3])
