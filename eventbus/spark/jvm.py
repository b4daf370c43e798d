"""The native path's one DataFrame: Parquet files with a given schema, then a projection, built
in the JVM in a fixed, small number of Py4J round trips.

PySpark hands a list to the JVM through py4j's list conversion, one round trip per item (16
segment paths, 31 projection expressions: about 50 of a read's 60 round trips), and every
``jvm.package.Class`` lookup is more of them. `parquet_select` sends each list as one JSON text
that Jackson (on Spark's class path) turns into a ``java.util.List`` in the JVM, and keeps the
few Java objects it needs per session: eight round trips, however many files and columns.

That fast route uses PySpark internals of a classic session: ``SparkSession._jvm`` and
``_jsparkSession``, ``pyspark.sql.classic.dataframe.DataFrame``, Spark's
``org.apache.spark.api.python.PythonUtils.toSeq`` and Jackson's ``ObjectMapper`` on Spark's class
path. When a PySpark or Spark upgrade has moved or changed one of them (an ``ImportError``, an
``AttributeError``, py4j's ``TypeError`` for a class it cannot find, a ``Py4JError`` for a Java
method that does not exist), the same DataFrame is built through the public API, the session
remembers it (the internals are probed once per session, not per read) and logger
``eventbus.spark`` says so once per process and missing piece. Errors of the read itself (a path
Spark cannot list, an analysis error) are raised as before, whichever route built the frame.

On a session without a JVM in this process (Spark Connect) it builds the same DataFrame through
the public API, without a warning.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("eventbus.spark")

# a session's Java objects, or the missing piece that sent its reads to the public API
_TOOLS: weakref.WeakKeyDictionary[Any, _Tools | str] = weakref.WeakKeyDictionary()
_SAID: set[str] = set()  # the missing pieces already logged in this process
_SAY_LOCK = threading.Lock()
KEPT = 8  # frames `kept_frame` keeps per session (each its JVM plan, a few kB)
# per session: `kept_frame`'s (frame class, JVM Dataset) by key, least recently used first
_KEPT_FRAMES: weakref.WeakKeyDictionary[Any, OrderedDict[Hashable, Any]] = (
    weakref.WeakKeyDictionary()
)
_KEPT_LOCK = threading.Lock()  # footer threads and a user's threads may read at once


class _Moved(Exception):
    """A PySpark internal the fast route uses is missing or changed: `piece` names it."""

    def __init__(self, piece: str, error: BaseException) -> None:
        self.piece, self.error = piece, _first_line(error)
        super().__init__(f"{piece}: {self.error}")


class _Tools:
    """A session's internals and Java objects: the JVM session, PySpark's classic ``DataFrame``,
    a Jackson mapper, ``java.util.List``'s class, ``toSeq``. Raises `_Moved` naming the first
    one missing or changed (about six Py4J round trips, once per session)."""

    def __init__(self, spark: Any, jsession: Any) -> None:
        self.jsession = jsession  # (not `spark`: the cache's value must not keep its key alive)
        with _piece("SparkSession._jvm"):
            jvm = spark._jvm
        with _piece("pyspark.sql.classic.dataframe.DataFrame"):
            from pyspark.sql.classic.dataframe import DataFrame

            self.frame = DataFrame
        with _piece("Jackson's com.fasterxml.jackson.databind.ObjectMapper on Spark's class path"):
            self.mapper = jvm.com.fasterxml.jackson.databind.ObjectMapper()
            self.list_class = jvm.java.lang.Class.forName("java.util.List")
        with _piece("org.apache.spark.api.python.PythonUtils.toSeq"):
            # the method itself: each attribute of a Java class is a round trip to look it up
            self.to_seq = jvm.org.apache.spark.api.python.PythonUtils.toSeq

    def seq(self, text: str) -> Any:
        """`text`, a JSON list of strings, as a Scala ``Seq[String]``: two round trips (JSON
        parsed, then wrapped)."""
        with _piece("Jackson's ObjectMapper.readValue / PythonUtils.toSeq"):
            return self.to_seq(self.mapper.readValue(text, self.list_class))

    def select(self, spark: Any, schema: str, paths: str, exprs: str) -> Any:
        """`parquet_select`'s DataFrame of session `spark` built in the JVM, `schema` as its
        JSON text, `paths` and `exprs` as JSON lists. Raises `_Moved` for a changed internal,
        and the read's own errors as they come."""
        with _piece("SparkSession._jsparkSession.parseDataType"):
            jschema = self.jsession.parseDataType(schema)
        with _piece("the JVM DataFrameReader's schema(StructType).parquet(Seq)"):
            raw = self.jsession.read().schema(jschema).parquet(self.seq(paths))
        with _piece("the JVM Dataset's selectExpr(Seq)"):
            selected = raw.selectExpr(self.seq(exprs))
        with _piece("pyspark.sql.classic.dataframe.DataFrame(jdf, session)"):
            return self.frame(selected, spark)


def parquet_select(spark: Any, schema: Any, paths: Sequence[str], exprs: Sequence[str]) -> Any:
    """``spark.read.schema(schema).parquet(*paths).selectExpr(*exprs)``: `schema` a
    `StructType` (the files' columns to read, no inference job), `paths` Hadoop URIs, `exprs`
    Spark SQL expressions. Built in the JVM in a fixed number of Py4J round trips, or through
    that public API when the session has no JVM here (Spark Connect) or an internal the fast
    route uses is missing (see the module docstring: one warning per process and missing
    piece). Raises what the public API raises (py4j / analysis errors: a path Spark cannot
    list, an expression naming no column)."""
    route = _route(spark)
    if isinstance(route, _Tools):
        # bad input fails here, not as if an internal were missing
        texts = schema.json(), json.dumps(list(paths)), json.dumps(list(exprs))
        try:
            return route.select(spark, *texts)
        except _Moved as moved:
            _TOOLS[spark] = moved.piece
            _say(moved)
    return spark.read.schema(schema).parquet(*paths).selectExpr(*exprs)


def kept_frame(spark: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """The DataFrame `build` made for `key` in session `spark`, kept (the last `KEPT` per
    session), else `build`'s new one. A stream's micro-batches read the same segments with
    other bounds, and building their relation (Spark checks each path, then analyses the
    projection) was most of a micro-batch's planning (`stress/spark_stream_breakdown.py`):
    `key` must name everything the frame depends on (a file's size as well as its path: a
    file rewritten with another size must not be read through a stale listing). What is kept
    is the JVM Dataset, not the frame (which would keep the session alive); a frame without
    one here (Spark Connect) is not kept."""
    with _KEPT_LOCK:
        kept = _KEPT_FRAMES.setdefault(spark, OrderedDict())
        hit = kept.get(key)
        if hit is not None:
            kept.move_to_end(key)
    if hit is not None:
        frame_class, jdf = hit
        return frame_class(jdf, spark)
    df = build()
    jdf = getattr(df, "_jdf", None)
    if jdf is not None:
        with _KEPT_LOCK:
            kept[key] = (type(df), jdf)
            while len(kept) > KEPT:
                kept.popitem(last=False)
    return df


def _route(spark: Any) -> _Tools | str:
    """`spark`'s `_Tools`, or why its reads use the public API: probed once per session."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:
        if type(spark).__module__.startswith("pyspark.sql.connect"):
            return "Spark Connect"  # no JVM in this process: the public API is the route
        moved = _Moved("SparkSession._jsparkSession", AttributeError("no _jsparkSession"))
        _say(moved)
        return moved.piece
    known = _TOOLS.get(spark)
    if known is not None:
        return known
    try:
        found: _Tools | str = _Tools(spark, jsession)
    except _Moved as moved:
        _say(moved)
        found = moved.piece
    _TOOLS[spark] = found
    return found


@contextmanager
def _piece(name: str) -> Iterator[None]:
    """Turns what a missing or changed internal raises into `_Moved` naming `name`; lets any
    other error through (a Java exception, a converted analysis error, a lost connection)."""
    try:
        yield
    except Exception as exc:
        if _is_moved(exc):
            raise _Moved(name, exc) from exc
        raise


def _is_moved(exc: BaseException) -> bool:
    """Whether `exc` is what a moved internal raises: an import or attribute error, py4j's
    ``TypeError`` (``'JavaPackage' object is not callable``: no such Java class), or py4j's
    ``Py4JError`` for a name the JVM does not have (``... does not exist``, ``Trying to call a
    package``). Not a Java exception, a lost connection, a failed authentication or a JVM
    object that is gone ("Target Object ID does not exist": a stopped session)."""
    from py4j.protocol import (  # type: ignore[import-untyped]
        Py4JError,
        Py4JJavaError,
        Py4JNetworkError,
    )

    if isinstance(exc, Py4JJavaError | Py4JNetworkError):
        return False
    if isinstance(exc, Py4JError):  # only py4j's answers for a name the JVM does not have
        text = str(exc)
        if "Target Object ID" in text:  # a JVM object gone (session stopped), not a move
            return False
        return "does not exist" in text or "Trying to call a package" in text
    return isinstance(exc, AttributeError | ImportError | TypeError)


def _say(moved: _Moved) -> None:
    with _SAY_LOCK:  # footer threads and a user's threads may read at once
        if moved.piece in _SAID:
            return
        _SAID.add(moved.piece)
    log.warning(
        "eventbus.spark: %s is missing or changed in this PySpark / Spark (%s); this session's "
        "native reads build their Parquet DataFrame through PySpark's public API instead (same "
        "rows, about one Py4J round trip per segment path and per column; said once per "
        "process)",
        moved.piece,
        moved.error,
    )


def _first_line(exc: BaseException) -> str:
    """`exc`'s type and the line of its text that says what is wrong: for py4j's errors the
    Java exception's line ("... does not exist"), which follows "An error occurred while
    calling ...", else the first line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    said = next((line for line in lines if "Exception:" in line), lines[0] if lines else "")
    return f"{type(exc).__name__}: {said[:300]}" if said else type(exc).__name__
