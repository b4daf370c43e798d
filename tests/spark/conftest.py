"""The Spark tests' fixtures: one local SparkSession for the session (about 15 s to start), with
the venv's python for workers, loopback only, the UI off and small shuffles."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# the moto S3 server and the per-test s3:// store of the tier tests
from tests.integration.tier.conftest import s3_endpoint, s3_env  # noqa: F401

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    # Spark's Python workers import the test models (tests/spark/spark_support.py)
    paths = [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    from pyspark.sql import SparkSession

    from eventbus.spark import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("eventbus-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    with pytest.MonkeyPatch.context() as patched:
        _keep_pytest_formatters(patched)
        yield session
    session.stop()
    # py4j logs "Closing down clientserver connection" (INFO) from __del__ at interpreter exit,
    # after pytest has closed the stream its handler writes to: a "--- Logging error ---" trace
    logging.getLogger("py4j").setLevel(logging.WARNING)


def _keep_pytest_formatters(patched: pytest.MonkeyPatch) -> None:
    """Keep PySpark from restyling pytest's log handlers for the rest of the test session.

    An `AnalysisException` with a query context (a column that does not exist) is logged by
    PySpark 4 through ``SQLQueryContextLogger``, a `PySparkLogger` with ``propagate = False``
    whose ``addHandler`` gives every handler PySpark's JSON formatter. pytest 9 attaches its
    capture handlers to every non-propagating logger at the start of each test phase, so from
    then on the session's ``caplog`` handler formatted every later test's records as PySpark
    JSON, which sets no ``record.message`` (tests/unit's routing case failed in CI on
    2026-11-27, after tests/spark/test_jvm.py). pytest's own handlers keep their formatter."""
    from pyspark.logger.logger import PySparkLogger

    restyle = PySparkLogger.addHandler

    def add_handler(self: Any, handler: logging.Handler) -> None:
        if type(handler).__module__.startswith("_pytest."):
            logging.Logger.addHandler(self, handler)
        else:
            restyle(self, handler)

    patched.setattr(PySparkLogger, "addHandler", add_handler)


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    """A topic name unique to the test."""
    import uuid

    return f"t-{uuid.uuid4().hex[:8]}"
