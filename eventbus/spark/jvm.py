"""The native path's one DataFrame: Parquet files with a given schema, then a projection, built
in the JVM in a fixed, small number of Py4J round trips.

PySpark hands a list to the JVM through py4j's list conversion, one round trip per item (16
segment paths, 31 projection expressions: about 50 of a read's 60 round trips), and every
``jvm.package.Class`` lookup is more of them. `parquet_select` sends each list as one JSON text
that Jackson (on Spark's class path) turns into a ``java.util.List`` in the JVM, and keeps the
few Java objects it needs per session: eight round trips, however many files and columns.

On a session without a JVM in this process (Spark Connect) it builds the same DataFrame through
the public API.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

_TOOLS: weakref.WeakKeyDictionary[Any, _Tools] = weakref.WeakKeyDictionary()


class _Tools:
    """A session's Java objects: a Jackson mapper, ``java.util.List``'s class, ``toSeq``."""

    def __init__(self, spark: Any) -> None:
        jvm = spark._jvm
        self.mapper = jvm.com.fasterxml.jackson.databind.ObjectMapper()
        self.list_class = jvm.java.lang.Class.forName("java.util.List")
        # the method itself: each attribute of a Java class is a round trip to look it up
        self.to_seq = jvm.org.apache.spark.api.python.PythonUtils.toSeq

    def seq(self, items: Sequence[str]) -> Any:
        """`items` as a Scala ``Seq[String]``: two round trips (JSON parsed, then wrapped)."""
        return self.to_seq(self.mapper.readValue(json.dumps(list(items)), self.list_class))


def parquet_select(spark: Any, schema: Any, paths: Sequence[str], exprs: Sequence[str]) -> Any:
    """``spark.read.schema(schema).parquet(*paths).selectExpr(*exprs)``: `schema` a
    `StructType` (the files' columns to read, no inference job), `paths` Hadoop URIs, `exprs`
    Spark SQL expressions. Raises what those raise (py4j / analysis errors: a path Spark cannot
    list, an expression naming no column)."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:  # Spark Connect: no JVM here
        return spark.read.schema(schema).parquet(*paths).selectExpr(*exprs)
    from pyspark.sql.classic.dataframe import DataFrame

    tools = _TOOLS.get(spark)
    if tools is None:
        tools = _TOOLS[spark] = _Tools(spark)
    jschema = jsession.parseDataType(schema.json())
    raw = jsession.read().schema(jschema).parquet(tools.seq(paths))
    return DataFrame(raw.selectExpr(tools.seq(exprs)), spark)
