"""The native path: `eventbus.spark.read` gives the rows of ``format("eventbus")`` on the same cut,
the archived part read by Spark's own Parquet reader; it falls back to the Python source, saying so
once, when it must."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from spark_support import Tick, offload, publish, ticks

from eventbus.spark import read

pytestmark = pytest.mark.integration


class BadTick(BaseModel):
    """Published as a Tick whose ``seq`` the registered Tick refuses."""

    __event_type__ = "Tick"
    resource: str
    seq: str


def rows(df: Any) -> list[dict[str, Any]]:
    got = [r.asDict(recursive=True) for r in df.collect()]
    return sorted(got, key=lambda r: (r["shard"], r["entry_ms"], r["entry_seq"]))


def archive(redis_db: str, store: str, topic: str, typed: bool) -> None:
    """300 ticks and a bad one archived (typed or not), then 40 more ticks left in Redis."""
    publish(redis_db, topic, [*ticks(300), ("res-1", BadTick(resource="res-1", seq="x"))])
    models = {topic: "spark_support:Tick"} if typed else {}
    offload(redis_db, store, topic, typed_models=models)
    publish(redis_db, topic, ticks(40, start=300))


def test_native_and_python_paths_give_the_same_rows(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "archive")
    archive(redis_db, store, topic, typed=True)
    options = {"store": store, "topic": topic, "redis_url": redis_db}
    for extra in ({}, {"model": "spark_support:Tick"}):  # raw, then typed
        native = read(spark, options, **extra)
        files = native.inputFiles()
        assert len(files) == len(list(Path(store).glob(f"{topic}/*/*.parquet"))) > 1
        python = spark.read.format("eventbus").options(**options, **extra).load()
        assert native.schema == python.schema
        got, want = rows(native), rows(python)
        assert len(got) == 341 and got == want
    typed = [r for r in got if r["seq"] is not None]
    assert sorted(r["seq"] for r in typed) == list(range(340))
    bad = [r for r in got if r["_corrupt"] is not None]
    assert len(bad) == 1 and bad[0]["_corrupt"].startswith("ValidationError: Tick: seq")
    # a filter on a typed payload field, with an OR: Spark prunes with Parquet statistics
    picked = read(spark, options, model="spark_support:Tick").where("seq < 5 OR seq >= 338")
    assert sorted(r.seq for r in picked.collect()) == [0, 1, 2, 3, 4, 338, 339]


def test_several_topics_are_read_natively_as_the_python_path_reads_them(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """``subscribe`` with two topics: each topic's cut planned, both topics' segments read by
    Spark's Parquet reader (it fell back to the Python source), both Redis tails unioned; the
    rows, ``topic`` column included, and the schema are the Python source's, row for row."""
    store = str(tmp_path / "archive")
    other = topic + "-b"
    archive(redis_db, store, topic, typed=True)
    publish(redis_db, other, ticks(150, start=1000))
    offload(redis_db, store, other, typed_models={other: "spark_support:Tick"})
    publish(redis_db, other, ticks(25, start=1150))
    options = {"store": store, "subscribe": f"{topic},{other}", "redis_url": redis_db}
    segments = {t: list(Path(store).glob(f"{t}/*/*.parquet")) for t in (topic, other)}
    for extra in ({}, {"model": "spark_support:Tick"}):  # raw, then typed
        native = read(spark, options, **extra)
        files = native.inputFiles()
        for t in (topic, other):  # each topic's segments, through the JVM's reader
            assert len([f for f in files if f"/{t}/" in f]) == len(segments[t]) > 1
        python = spark.read.format("eventbus").options(**options, **extra).load()
        assert native.schema == python.schema
        got = sorted(rows(native), key=lambda r: r["topic"])
        assert got == sorted(rows(python), key=lambda r: r["topic"])
        assert len(got) == 341 + 175
        assert {r["topic"] for r in got} == {topic, other}
    seqs = {
        t: sorted(r["seq"] for r in got if r["topic"] == t and r["seq"] is not None)
        for t in (topic, other)
    }
    assert seqs == {topic: list(range(340)), other: list(range(1000, 1175))}


def test_untyped_segments_fall_back_to_the_python_path_said_on_the_driver_per_read(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = str(tmp_path / "archive")
    archive(redis_db, store, topic, typed=False)
    options = {"store": store, "topic": topic, "redis_url": redis_db, "model": Tick}
    with caplog.at_level(logging.WARNING, "eventbus.spark"):
        with pytest.warns(RuntimeWarning, match="5 of 5 segments have no typed columns"):
            first = read(spark, options)
        with pytest.warns(RuntimeWarning, match="falls back to the Python source"):
            again = read(spark, options)
    said = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(said) == 2 and "have no typed columns" in said[0]
    assert first.inputFiles() == [] or all("archive" not in f for f in first.inputFiles())
    python = spark.read.format("eventbus").options(
        store=store, topic=topic, redis_url=redis_db, model="spark_support:Tick"
    )
    assert rows(first) == rows(again) == rows(python.load())


def test_an_empty_or_redis_only_topic(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = tmp_path / "archive"
    store.mkdir()
    publish(redis_db, topic, ticks(10))
    df = read(spark, store=str(store), topic=topic, redis_url=redis_db, model=Tick)
    assert sorted(r.seq for r in df.collect()) == list(range(10))


def test_a_store_the_jvm_cannot_read_falls_back(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Hadoop takes ``[`` in a path as a glob: Spark's reader cannot list the segments that
    obstore reads (as it cannot read ``s3://`` without the S3A jars): the Python path reads."""
    store = str(tmp_path / "arch[ive")
    publish(redis_db, topic, ticks(120))
    offload(redis_db, store, topic, typed_models={topic: "spark_support:Tick"})
    with caplog.at_level(logging.WARNING, "eventbus.spark"):
        df = read(spark, store=store, topic=topic, redis_url=redis_db, model=Tick)
    said = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(said) == 1 and "Spark cannot read" in said[0]
    assert sorted(r.seq for r in df.collect()) == list(range(120))


def test_a_typed_read_is_one_relation_in_the_read_order_renamed_without_a_cast(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """The segments' schema is given in the read's column order: the projection over the
    Parquet relation is column names, three renames and ``timestamp_millis``, no ``CAST``
    (a cast per renamed column, even to the same type, was most of the analyzer's work)."""
    store = str(tmp_path / "archive")
    archive(redis_db, store, topic, typed=True)
    df = read(spark, store=store, topic=topic, model=Tick)  # no redis_url: the archive alone
    python = spark.read.format("eventbus").options(
        store=store, topic=topic, model="spark_support:Tick"
    )
    assert df.schema == python.load().schema
    plan = df._jdf.queryExecution().analyzed()
    assert "cast(" not in plan.toString().lower()
    relation = plan.collectLeaves().apply(0).output()
    columns = [relation.apply(i).name() for i in range(relation.size())]
    renamed = {"published_at": "event_time_ms", "payload": "data", "_corrupt": "typed_error"}
    assert columns == [renamed.get(n, n) for n in df.schema.fieldNames()]
    assert rows(df) == rows(python.load())


def test_reads_share_the_footer_threads_and_the_models_typed_columns(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first typed read, further reads of the same models share its pool of threads
    that fetch the segments' footers (a pool was started per read) and do not build
    the models' `TypedPayloads` again (its validators: most of a read's Python time), nor the
    segments' Spark schema and projection (`_columns`)."""
    import threading

    import eventbus.spark.native as native

    store = str(tmp_path / "archive")
    archive(redis_db, store, topic, typed=True)
    assert len(list(Path(store).glob(f"{topic}/*/*.parquet"))) > 1
    options = {"store": store, "topic": topic, "model": Tick}
    want = rows(read(spark, options))  # the first read: the pool and the typed columns made
    pool = native._footer_pool()
    built: list[Any] = []
    typed_struct = native.typed_struct

    def build(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return typed_struct(*args, **kwargs)

    def convert(*args: Any) -> Any:
        built.append(args)
        return from_arrow(*args)

    from_arrow = native.from_arrow_schema
    monkeypatch.setattr(native, "typed_struct", build)
    monkeypatch.setattr(native, "from_arrow_schema", convert)
    frames = [read(spark, options) for _ in range(3)]
    monkeypatch.undo()
    # the one pool's threads start as its tasks find none idle: at most its 8 in all
    footers = [t for t in threading.enumerate() if t.name.startswith("eventbus-footers")]
    assert native._footer_pool() is pool
    assert len(footers) <= 8
    assert built == []
    assert all(rows(f) == want for f in frames)


def test_a_read_sends_few_py4j_commands_however_many_segments_and_columns(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the native DataFrame sends the same few Py4J commands for 4 segments as for
    16, and for a typed read as for a raw one: the paths and the projection's expressions go to
    the JVM as one JSON text each (py4j's list conversion was a round trip per path and per
    column: 60 and more commands a read)."""
    store = str(tmp_path / "archive")
    client = spark.sparkContext._gateway._gateway_client
    send = client.send_command
    sent: list[str] = []

    def counted(command: str, *args: Any, **kwargs: Any) -> Any:
        if not command.startswith("m\n"):  # not a release of a Java object Python dropped
            sent.append(command)
        return send(command, *args, **kwargs)

    counts = {}
    for shards in (4, 16):
        name = f"{topic}-{shards}"
        publish(redis_db, name, ticks(200, resources=200), shards=shards)
        offload(redis_db, store, name, shards=shards, typed_models={name: "spark_support:Tick"})
        files = list(Path(store).glob(f"{name}/*/*.parquet"))
        assert len(files) >= shards
        for extra in ({}, {"model": Tick}):
            options = {"store": store, "topic": name, **extra}
            want = rows(read(spark, options))  # a first read: the session's Java helpers made
            monkeypatch.setattr(client, "send_command", counted)
            sent.clear()
            df = read(spark, options)
            counts[shards, bool(extra)] = len(sent)
            monkeypatch.undo()
            assert len(df.inputFiles()) == len(files)
            assert rows(df) == want
    assert max(counts.values()) <= 10, counts
    assert len(set(counts.values())) == 1, counts


def test_the_footers_are_checked_while_spark_builds_the_relation(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segments' typed versions are read from their footers by the footer threads while
    the JVM builds the Parquet relation (each footer here waits until that has started), and
    still decide the path: the frame is the native one only once all of them matched."""
    import threading

    import eventbus.spark.native as native

    store = str(tmp_path / "archive")
    archive(redis_db, store, topic, typed=True)
    options = {"store": store, "topic": topic, "model": Tick}
    building = threading.Event()
    overlapped: list[bool] = []
    footer, select = native.parquet_footer, getattr(native, "parquet_select", None)

    def slow_footer(*args: Any) -> Any:
        overlapped.append(building.wait(timeout=10))  # a bound for a failure only
        return footer(*args)

    def noted_select(*args: Any) -> Any:
        building.set()
        return select(*args)  # type: ignore[misc]

    monkeypatch.setattr(native, "parquet_footer", slow_footer)
    monkeypatch.setattr(native, "parquet_select", noted_select, raising=False)
    df = read(spark, options)
    monkeypatch.undo()
    segments = list(Path(store).glob(f"{topic}/*/*.parquet"))
    assert len(overlapped) == len(segments) > 1 and all(overlapped)
    assert len(df.inputFiles()) == len(segments)


def test_segments_of_several_typed_versions_are_read_natively_as_one_schema(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Schema evolution: segments written for `Tick`, then more for `TickV2` (a field added).
    A typed read of either model reads every segment natively as one schema (``venue`` is null
    in the earlier segments, as Spark's mergeSchema reads them); the rows are the Python
    path's (which decodes ``data``: `TickV2`'s ``venue`` defaults to None)."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(200))
    offload(redis_db, store, topic, typed_models={topic: "spark_support:Tick"})
    old = set(Path(store).glob(f"{topic}/*/*.parquet"))
    publish(redis_db, topic, ticks(30, start=200))
    offload(redis_db, store, topic, typed_models={topic: "spark_support:TickV2"})
    new = set(Path(store).glob(f"{topic}/*/*.parquet")) - old
    assert old and new
    for model in ("spark_support:TickV2", "spark_support:Tick"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning
            df = read(spark, store=store, topic=topic, model=model)
        assert len(df.inputFiles()) == len(old) + len(new)
        python = spark.read.format("eventbus").options(store=store, topic=topic, model=model)
        got = rows(df)
        assert got == rows(python.load())
        assert sorted(r["seq"] for r in got) == list(range(230))


def test_without_a_jvm_in_this_process_the_frame_is_built_through_the_public_api(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """`parquet_select` on a session with no ``_jsparkSession`` (Spark Connect's) builds the
    same DataFrame with ``spark.read...selectExpr``: same schema, same rows."""
    from eventbus.spark.jvm import parquet_select

    store = tmp_path / "archive"
    archive(redis_db, str(store), topic, typed=False)
    paths = sorted(f"file://{p.resolve()}" for p in store.glob(f"{topic}/*/*.parquet"))
    schema = spark.read.parquet(*paths).schema
    exprs = ["`resource_id` AS `rid`", "timestamp_millis(event_time_ms) AS `at`", "data"]

    class Public:  # a session of the public API only
        read = spark.read

    made = [parquet_select(s, schema, paths, exprs) for s in (spark, Public())]
    assert made[0].schema == made[1].schema
    assert made[0].columns == ["rid", "at", "data"]
    assert sorted(made[0].collect()) == sorted(made[1].collect())
    assert len(made[0].collect()) == 301


def test_reads_of_the_same_segments_share_one_relation_each_with_its_own_bounds(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded reads of the same segment (a stream's micro-batches within it) build Spark's
    Parquet relation once and filter it each by its own bounds: each gives exactly its own
    rows. A segment rewritten with another size (same key) gets a relation of its own, not the
    stale file listing."""
    import itertools
    import json

    import pyarrow.parquet as pq

    import eventbus.spark.native as native

    store = str(tmp_path / "archive")
    ids = publish(redis_db, topic, ticks(200), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:Tick"})
    built: list[Any] = []
    select = native.parquet_select

    def counted(*args: Any) -> Any:
        built.append(args)
        return select(*args)

    monkeypatch.setattr(native, "parquet_select", counted)
    # ranges inside the segment holding the 100th tick: each read covers it alone
    inside = next(
        pq.read_table(f, columns=["entry_id"]).column(0).to_pylist()
        for f in Path(store).glob(f"{topic}/*/*.parquet")
        if ids[100] in pq.read_table(f, columns=["entry_id"]).column(0).to_pylist()
    )
    first = ids.index(inside[0])
    assert len(inside) >= 8
    cuts = [first, first + 2, first + len(inside) // 2, first + len(inside) - 1]
    for lo, hi in [*itertools.pairwise(cuts), (cuts[1], cuts[2] + 1)]:
        options = {
            "store": store,
            "topic": topic,
            "model": Tick,
            "startingOffsets": json.dumps({topic: {"0": ids[lo]}}),
            "endingOffsets": json.dumps({topic: {"0": ids[hi]}}),
        }
        got = [r.seq for r in read(spark, options).collect()]
        assert sorted(got) == list(range(lo + 1, hi + 1))
    assert len(built) == 1
    (segment,) = [
        f
        for f in Path(store).glob(f"{topic}/*/*.parquet")
        if pq.read_table(f, columns=["entry_id"]).column(0).to_pylist() == inside
    ]
    pq.write_table(pq.read_table(segment), segment, compression="none")  # another size
    got = [r.seq for r in read(spark, options).collect()]  # the last bounds again
    assert sorted(got) == list(range(cuts[1] + 1, cuts[2] + 2)) and len(built) == 2
