"""Spark benchmark: the eventbus source against pyarrow on the same segments, the writer against
``publish_many``.

    python stress/spark_bench.py                    # the first 200,000 NYC flights of 2013
    python stress/spark_bench.py --events 336776    # the whole year
    python stress/spark_bench.py --out stress/results/spark_bench.json   # or --json

Starts a private redis-server (or uses REDIS_URL, whose database it FLUSHES), publishes the
flights with ``bus.publish_many`` (timed: the writer's reference), archives them with the
offloader to a temporary folder, starts a local SparkSession (``local[2]``, adaptive query
execution off: a small-data setting, docs/spark.md), then measures every read the same way
(`measure`): one untimed warm-up run of the same query on the same data and session, then
``--runs`` timed runs (default 3), of which the median is kept; a run includes building the
DataFrame (planning the cut, listing, analysis) and the job, and rows are counted each time:

* ``pyarrow``: ``pq.read_table`` of every segment file, in this process, one thread: the ceiling
  of reading these files at all;
* ``pyarrow_in_spark``: the same reads inside Spark tasks (``mapInArrow`` over the file list,
  one task per file), batches handed to the JVM: the ceiling of any Python source in Spark;
* ``raw``: ``spark.read.format("eventbus")`` (verified segments, Arrow batches), ``count()``;
* ``typed``: the same with ``model=Flight`` (payloads decoded and validated by pydantic), and
  ``typed_arrow`` with ``validate=false`` (payload maps converted by Arrow);
* ``typed_agg`` / ``typed_native``: a typed aggregate (``count(*)``, ``sum(dep_delay)``) through
  the Python source and through `eventbus.spark.read`'s native path (Spark's Parquet reader on
  the typed segment columns), same cut; ``plain_parquet``: the same aggregate over a plain
  ``spark.read.parquet`` of the same files (schema inferred, as a user writes it) and
  ``plain_parquet_schema`` (schema given: no inference job), the reference the native path's
  cost is compared with; these four also give ``plan_s`` (building the DataFrame) and
  ``exec_s`` (the job), medians; ``typed_native`` and the two ``plain_parquet`` runs alternate
  round by round (`measure_alternated`: measured one after the other, the first ran its jobs
  in a JVM less warmed up than the next), each round in the next of their orders (all 3! of
  them in turn, so each read runs first, second and last, and after each other one), after
  ``NATIVE_WARMUP`` untimed rounds and for at least ``NATIVE_RUNS`` timed ones (a read of
  these takes about 0.3 s, and its median over 3 runs moved by ±20 % between two quiet runs);
  ``duckdb_typed``: the same aggregate in DuckDB with
  one ``read_parquet`` of the archive;
* ``offload_us_per_event``: `encode_segment` of 50,000 of the entries, raw and with typed columns;
* ``writer``: ``df.write.format("eventbus")`` of the same flights to another topic, each run to
  a new one: the session's first write (``first_run_s``: the sink's Python workers start), then
  runs alternated with the same write into an empty Python sink (``empty_sink``: Spark's own
  cost of any Python writer, ``spark_share`` of the writer's seconds), no warm-up.
* ``native_docs_forms``: the path `eventbus.spark.read` takes with docs/tier.md's setting form
  (``{"<event type>": "pkg:Model"}``, the archive's) and docs/spark.md's ``model="pkg:Model"``;
* ``bounded_native``: the typed aggregate of a bounded read (per shard after the entry at a
  quarter, up to the one at three quarters), natively; rate over the rows read;
* ``stream_available_now`` / ``stream_available_now_100k``: a typed ``Trigger.AvailableNow``
  stream of the archive (`eventbus.spark.read_stream`: micro-batches read natively; no limit;
  ``maxOffsetsPerTrigger=100000``), each micro-batch through ``foreachBatch`` running
  ``typed_native``'s aggregate (``--stream-sink agg``, the default since session 7: the ratio
  compares one query, streamed and not) or writing every column to Spark's ``noop`` sink
  (``--stream-sink noop``, the sink before); ``stream_python_available_now``: the first
  through ``readStream.format("eventbus")`` (the Python source's micro-batches), same sink;
  a stream that sees other than every archived row gets ``error`` (what it saw) and no rate;
* ``native_after_evolution``: after a tenth more flights were archived with a model version
  that adds a field, the typed aggregate of the whole topic read natively with that version;
* each with ``ratio_typed_native`` (its rate over ``typed_native``'s); ``writer`` has
  ``ratio_publish_many``.

All rates are events/s. ``method`` in the output states the above. Prints one JSON object (and
writes it to ``--out``). The machine's load moves every figure: compare paths of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eventbus import EventBus, Settings  # noqa: E402
from examples.flights.flightdata import load_flights  # noqa: E402
from localredis.server import RedisServer  # noqa: E402

MODEL = "examples.flights.flightdata:Flight"
EVENT_TYPE = "flights.Flight"
DOCS_SETTING = {EVENT_TYPE: MODEL}  # docs/tier.md's form of the offloader's typed_models
EVOLVED = "__main__:FlightV2"  # `Flight` with a field added: the archive's second version


def _evolved() -> Any:
    from examples.flights.flightdata import Flight

    class FlightV2(Flight):
        source: str | None = None

    FlightV2.__module__, FlightV2.__qualname__ = "__main__", "FlightV2"
    return FlightV2


FlightV2 = _evolved()


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    with RedisServer() as server:
        yield server.url


WARMUP_RUNS = 1
SECTIONS = ("python", "bounded", "stream", "writer", "evolution")  # ``--only``
NATIVE_WARMUP, NATIVE_RUNS = 3, 9  # the alternated native / plain Parquet reads (see above)
SPARK_CONF = {"spark.sql.adaptive.enabled": "false"}  # docs/spark.md: settings for small data


def measure(fn: Callable[[], Any], n: int, runs: int, warmup: int = WARMUP_RUNS) -> dict[str, Any]:
    """Run `fn` `warmup` times untimed, then `runs` times timed; the median run's seconds and
    rate (events/s), the fastest and slowest seconds. `fn` returns the rows it saw, or (rows,
    seconds spent building the DataFrame): then ``plan_s`` and ``exec_s`` (the rest) are the
    medians of the two phases. Exits when a run sees other than `n` rows."""
    return measure_alternated({"fn": fn}, n, runs, warmup)["fn"]


def measure_alternated(
    fns: dict[str, Callable[[], Any]],
    n: int | dict[str, int],
    runs: int,
    warmup: int = WARMUP_RUNS,
) -> dict[str, dict[str, Any]]:
    """`measure` of each of `fns`, their runs alternated round by round, each round in the
    next of their orders (A B C, A C B, B A C, ...: every permutation in turn, so that each
    runs after each other one as often as it can), so that the JVM's warming up (JIT), the
    machine's load and a run's place after another read move them alike: per name, what
    `measure` gives. `n`: the rows every read sees, or per name."""
    rows_of = n if isinstance(n, dict) else dict.fromkeys(fns, n)
    times: dict[str, list[float]] = {name: [] for name in fns}
    plans: dict[str, list[float]] = {name: [] for name in fns}
    orders = list(itertools.permutations(fns))
    for i in range(warmup + runs):
        for name in orders[i % len(orders)]:
            fn = fns[name]
            started = time.perf_counter()
            got = fn()
            took = time.perf_counter() - started
            rows, plan = got if isinstance(got, tuple) else (got, None)
            if rows != rows_of[name]:
                raise SystemExit(f"{name}: expected {rows_of[name]} rows, got {rows}")
            if i >= warmup:
                times[name].append(took)
                if plan is not None:
                    plans[name].append(plan)
    return {name: _summary(times[name], plans[name], rows_of[name]) for name in fns}


def _summary(times: list[float], plans: list[float], n: int) -> dict[str, Any]:
    median = statistics.median(times)
    out: dict[str, Any] = {
        "seconds": round(median, 3),
        "events_per_s": round(n / median, 1),
        "min_s": round(min(times), 3),
        "max_s": round(max(times), 3),
    }
    out["runs_s"] = [round(t, 3) for t in times]  # every timed run, in order
    if plans:
        out["plan_s"] = round(statistics.median(plans), 3)
        jobs = [t - p for t, p in zip(times, plans, strict=True)]
        out["exec_s"] = round(statistics.median(jobs), 3)
        out["plans_s"] = [round(p, 3) for p in plans]
        out["execs_s"] = [round(j, 3) for j in jobs]
    return out


async def publish_and_archive(
    url: str, topic: str, rows: list[Any], store: str, models: Any = None
) -> float:
    """Publish `rows` with ``publish_many`` (its seconds returned) and archive them with
    typed segments of `models` (the offloader's setting for the topic; default docs/tier.md's
    form, ``{"<event type>": "pkg:Model"}``)."""
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    bus = EventBus(Settings(redis_url=url, shards=16))
    try:
        async with bus:
            events = [(r.plane, r.event()) for r in rows]
            started = time.perf_counter()
            await bus.publish_many(topic, events)
            publish_s = time.perf_counter() - started
            tier = TierSettings(
                hot_window_s=0,
                segment_max_age_s=0,
                trim_exact=True,
                typed_models={topic: models or DOCS_SETTING},  # typed segments, read natively
            )
            await offload_until_caught_up(
                bus.redis,
                open_store(store),
                topics=[topic],
                settings=bus.settings,
                tier=tier,
                timeout_s=900,
            )
    finally:
        await bus.aclose()
    return publish_s


def offload_cost(topic: str, n: int, runs: int) -> dict[str, float]:
    """`encode_segment` (the offloader's CPU per segment) of `n` flights as published:
    microseconds per event, raw and with typed columns (`measure`'s median)."""
    from eventbus.protocol.codec import Envelope, encode_entry, new_event_id
    from eventbus.protocol.ids import EntryId
    from eventbus.tier.segment_write import encode_segment
    from eventbus.tier.typed import TypedPayloads, load_models

    entries = []
    for i, f in enumerate(load_flights(None, n)):
        payload = f.event().model_dump(mode="json")
        env = Envelope(f.plane, "flights.Flight", new_event_id(), 1, {}, payload)
        entries.append((EntryId(1 + i, 0), encode_entry(env)))
    typed = TypedPayloads(load_models(MODEL) or {})
    out = {}
    for name, t in (("raw", None), ("typed", typed)):

        def encode(t: TypedPayloads | None = t) -> int:
            encode_segment(topic, 0, entries[0][0], entries[-1][0], entries, typed=t)
            return n

        out[name] = round(measure(encode, n, runs)["seconds"] / n * 1e6, 2)
    return out


def path_of(build: Callable[[], Any]) -> str:
    """``"native"`` when `build` (an `eventbus.spark.read`) reads every segment through
    Spark's Parquet reader without a fallback warning, ``"partial"`` when some segments go
    through the Python source, else ``"python"``."""
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        df = build()
    texts = [str(w.message) for w in said if "Python source" in str(w.message)]
    if not df.inputFiles():
        return "python"
    return "partial" if texts else "native"


def bounded(
    spark: Any, store: str, opts: dict[str, Any], files: list[str], runs: int, phased: Any
) -> dict[str, Any]:
    """The typed aggregate of a bounded read (``startingOffsets`` / ``endingOffsets``: per
    shard, after its entry at a quarter and up to its entry at three quarters, inside
    segments), natively; rate over the rows read. Its runs alternate with the whole topic's
    native read (`measure_alternated`, as ``typed_native``): ``ratio_typed_native`` is over
    that read's rate of the same rounds (``typed_native_alternated``)."""
    import pyarrow.parquet as pq

    from eventbus.spark import read
    from eventbus.tier.layout import parse_segment_key

    def shard(f: str) -> str:  # the shard of a segment file, either layout's folder
        ref = parse_segment_key(f)
        assert ref is not None, f
        return str(ref.shard)

    starts: dict[str, str] = {}
    ends: dict[str, str] = {}
    for s in sorted({shard(f) for f in files}, key=int):
        ids = [
            i
            for f in files
            if shard(f) == s
            for i in pq.read_table(f, columns=["entry_id"]).column(0).to_pylist()
        ]
        if len(ids) >= 4:
            starts[s], ends[s] = ids[len(ids) // 4], ids[3 * len(ids) // 4]
    expected = sum(
        1
        for f in files
        for i in pq.read_table(f, columns=["entry_id"]).column(0).to_pylist()
        if shard(f) not in starts or _id(starts[shard(f)]) < _id(i) <= _id(ends[shard(f)])
    )
    topic = opts["topic"]
    options = {
        **opts,
        "startingOffsets": json.dumps({topic: starts}),
        "endingOffsets": json.dumps({topic: ends}),
    }
    n = sum(pq.read_metadata(f).num_rows for f in files)
    both = measure_alternated(
        {
            "bounded": phased(lambda: read(spark, options)),
            "whole": phased(lambda: read(spark, opts)),
        },
        {"bounded": expected, "whole": n},
        max(runs, NATIVE_RUNS),
        NATIVE_WARMUP,
    )
    out = both["bounded"]
    out["typed_native_alternated"] = both["whole"]["events_per_s"]
    out["ratio_typed_native"] = round(out["events_per_s"] / both["whole"]["events_per_s"], 3)
    out["rows"] = expected
    out["path"] = path_of(lambda: read(spark, options))
    return out


def _id(text: str) -> tuple[int, int]:
    ms, seq = text.split("-")
    return int(ms), int(seq)


def _sink(how: str, seen: list[int]) -> Callable[[Any, int], None]:
    """A ``foreachBatch`` function counting each micro-batch's rows into `seen`: ``agg`` runs
    ``typed_native``'s query on it (``count(*)``, ``sum(dep_delay)``: the stream's rate against
    the batch read's of the same query), ``noop`` writes every column to Spark's ``noop`` sink
    (an ``Observation`` counts the rows)."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    def save(df: Any, batch_id: int) -> None:
        if how == "agg":
            seen.append(int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0]))
            return
        counted = Observation()
        df.observe(counted, F.count(F.lit(1)).alias("n")).write.format("noop").mode("append").save()
        seen.append(counted.get["n"])

    return save


def python_stream_run(
    spark: Any, opts: dict[str, Any], limit: int | None, how: str = "agg"
) -> Callable[[], int]:
    """A ``Trigger.AvailableNow`` stream of the archive (typed, the Python source's
    micro-batches: ``readStream.format("eventbus")``), each micro-batch given to `_sink`'s
    function (`how`), each run from a new checkpoint: rows read."""

    def run() -> int:
        seen: list[int] = []
        reader = spark.readStream.format("eventbus").options(**opts)
        if limit:
            reader = reader.option("maxOffsetsPerTrigger", str(limit))
        with tempfile.TemporaryDirectory(prefix="spark-bench-ckpt-") as ckpt:
            q = (
                reader.load()
                .writeStream.foreachBatch(_sink(how, seen))
                .option("checkpointLocation", ckpt)
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
        return sum(seen)

    return run


def stream_run(
    spark: Any, opts: dict[str, Any], limit: int | None, how: str = "agg"
) -> Callable[[], int]:
    """A typed ``Trigger.AvailableNow`` stream of the archive with `eventbus.spark.read_stream`
    (micro-batches planned by the eventbus stream, read natively), each micro-batch given to
    `_sink`'s function (`how`), each run from a new checkpoint: rows seen."""
    from eventbus.spark import read_stream

    def run() -> int:
        seen: list[int] = []
        options = {**opts, **({"maxOffsetsPerTrigger": limit} if limit else {})}
        with tempfile.TemporaryDirectory(prefix="spark-bench-ckpt-") as ckpt:
            q = (
                read_stream(spark, _sink(how, seen), options)
                .option("checkpointLocation", ckpt)
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
        return sum(seen)

    return run


def writer_section(
    spark: Any, url: str, rows: list[Any], publish_many: dict[str, Any], runs: int
) -> dict[str, Any]:
    """``df.write.format("eventbus")`` of `rows` (a cached DataFrame, two partitions by plane,
    sorted by position), each run to a new topic: its first run in the session (``first_run_s``:
    the sink's Python workers start and import eventbus), then ``max(runs, 3)`` runs alternated
    with the same write into an empty Python sink (`_empty_sink`: Spark's own cost, the Python
    workers and the Arrow batches they are handed, ``empty_sink``). ``ratio_publish_many``: the
    writer's median rate over ``publish_many``'s (a warm process whose events were built
    before its clock started); ``spark_share``: the empty sink's seconds over the writer's."""
    from spark_writer import flights_frame  # (stress/, this script's folder)

    spark.dataSource.register(_empty_sink())
    n = len(rows)
    frame = flights_frame(spark, rows)
    topics = (f"bench-b{i}" for i in itertools.count())

    def write() -> int:
        (
            frame.write.format("eventbus")
            .option("topic", next(topics))
            .option("redis_url", url)
            .option("resource_id_col", "plane")
            .option("model", MODEL)
            .option("event_id_col", "position")
            .option("shards", "16")
            .mode("append")
            .save()
        )
        return n

    def empty() -> int:
        frame.write.format("bench-empty-sink").mode("append").save()
        return n

    started = time.perf_counter()
    write()
    first_s = time.perf_counter() - started
    both = measure_alternated({"writer": write, "empty_sink": empty}, n, max(runs, 3), 0)
    out = both["writer"]
    out["first_run_s"] = round(first_s, 3)
    out["empty_sink"] = both["empty_sink"]
    out["ratio_publish_many"] = round(out["events_per_s"] / publish_many["events_per_s"], 3)
    out["vs_publish_many"] = out["ratio_publish_many"]
    out["spark_share"] = round(both["empty_sink"]["seconds"] / out["seconds"], 3)
    return out


def _empty_sink() -> Any:
    """A Python data source (format ``bench-empty-sink``) whose writer drops its batches."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Writer(DataSourceArrowWriter):
        def write(self, iterator: Any) -> WriterCommitMessage:
            for _ in iterator:  # every batch handed over, as to the eventbus writer
                pass
            return WriterCommitMessage()

    class Sink(DataSource):
        """A Python sink that drops its rows: Spark's cost of any Python writer."""

        @classmethod
        def name(cls) -> str:
            return "bench-empty-sink"

        def writer(self, schema: Any, overwrite: bool) -> Any:
            return Writer()

    return Sink


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals met by `result` (those of the sections run)."""
    rate = result["typed_native"]["events_per_s"]
    out = {"typed_native_at_least_1m": rate >= 1_000_000}
    if "raw" in result:
        out["raw_at_least_half_pyarrow_in_spark"] = result["raw"]["vs_pyarrow_in_spark"] >= 0.5
        out["typed_at_least_200k"] = result["typed"]["events_per_s"] >= 200_000
        out["typed_native_at_least_10x_typed_python"] = (
            result["typed_native"]["vs_typed_python"] >= 10
        )
    out["native_docs_forms_native"] = result["native_docs_forms"]["path"] == "native"
    if "native_after_evolution" in result:
        ratio = result["native_after_evolution"]["ratio_typed_native"]
        out["native_after_evolution_at_least_0_8"] = ratio >= 0.8
    if "bounded_native" in result:
        ratio = result["bounded_native"]["ratio_typed_native"]
        out["bounded_native_at_least_0_5"] = ratio >= 0.5
    if "stream_available_now" in result:
        ratio = result["stream_available_now"].get("ratio_typed_native", 0)
        out["stream_available_now_at_least_0_5"] = ratio >= 0.5
        rate = result["stream_available_now_100k"]["events_per_s"] or 0
        out["stream_available_now_100k_at_least_200k"] = rate >= 200_000
    if "writer" in result:
        out["writer_at_least_publish_many"] = result["writer"]["ratio_publish_many"] >= 1.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--out", "--json", type=Path, help="write the JSON result here too")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per read (median kept)")
    parser.add_argument(
        "--stream-sink",
        choices=("agg", "noop"),
        default="agg",
        help="what each stream micro-batch does: typed_native's aggregate (default), or a noop "
        "write of every column (the sink of sessions before 7)",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections to run (typed_native always runs, the reference of the "
        f"ratios): {', '.join(SECTIONS)}; default all",
    )
    args = parser.parse_args()
    runs = args.runs
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"--only: unknown sections {sorted(only - set(SECTIONS))}")

    rows = load_flights(None, args.events)
    n = len(rows)
    result: dict[str, Any] = {
        "events": n,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "method": {
            "warmup_runs": WARMUP_RUNS,
            "timed_runs": args.runs,
            "native_and_plain_parquet": {
                "warmup_rounds": NATIVE_WARMUP,
                "timed_rounds": max(args.runs, NATIVE_RUNS),
                "order": "alternated, each round in the next permutation of the reads",
            },
            "statistic": "median",
            "timed": "building the DataFrame (planning, listing, analysis) and the job, every "
            "read path alike; writer: its first run apart, then runs alternated with an empty sink",
            "spark_conf": SPARK_CONF,
            "stream_sink": args.stream_sink,
        },
    }
    with redis_url() as url, tempfile.TemporaryDirectory(prefix="spark-bench-") as store:
        import redis

        redis.Redis.from_url(url).flushdb()
        publish_s = anyio.run(publish_and_archive, url, "bench-a", rows, store)
        result["publish_many"] = {"events_per_s": round(n / publish_s, 1)}
        files = sorted(str(p) for p in Path(store).rglob("*.parquet"))
        result["segments"] = len(files)
        result["segment_bytes"] = sum(Path(f).stat().st_size for f in files)

        import pyarrow.parquet as pq

        if "python" in only:
            result["pyarrow"] = measure(
                lambda: sum(pq.read_table(f).num_rows for f in files), n, runs
            )

        started = time.perf_counter()
        from examples.flights.spark_step import start_spark

        spark = start_spark()
        for key, value in SPARK_CONF.items():
            spark.conf.set(key, value)
        result["spark_startup_s"] = round(time.perf_counter() - started, 1)

        def arrow_in_spark() -> int:
            from pyspark.sql.pandas.types import from_arrow_schema

            def read(batches: Any) -> Any:
                import pyarrow.parquet as pq

                for b in batches:
                    for path in b.column(0).to_pylist():
                        # the topic column is a dictionary, which Spark does not take as is
                        yield from pq.read_table(path).drop_columns(["topic"]).to_batches()

            schema = from_arrow_schema(pq.read_schema(files[0]).remove(0))
            paths = spark.createDataFrame([(f,) for f in files], "path string")
            return paths.repartition(len(files)).mapInArrow(read, schema).count()

        if "python" in only:
            result["pyarrow_in_spark"] = measure(arrow_in_spark, n, runs)

        def source(**options: str) -> Callable[[], int]:
            def run() -> int:
                r = spark.read.format("eventbus").option("store", store).option("topic", "bench-a")
                for k, v in options.items():
                    r = r.option(k, v)
                return r.load().count()

            return run

        from pyspark.sql import functions as F

        from eventbus.spark import read

        def typed_agg(df: Any) -> int:
            return int(df.agg(F.count("*"), F.sum("dep_delay")).first()[0])

        def phased(build: Callable[[], Any]) -> Callable[[], tuple[int, float]]:
            """The typed aggregate of the DataFrame `build` gives, and the seconds `build` took."""

            def run() -> tuple[int, float]:
                started = time.perf_counter()
                df = build()
                planned = time.perf_counter() - started
                return typed_agg(df), planned

            return run

        opts = {"store": store, "topic": "bench-a", "model": MODEL}
        uris = [f"file://{Path(f).resolve()}" for f in files]  # (as_uri: shard%3D0, not found)
        if "python" in only:
            result["typed_agg"] = measure(
                phased(lambda: spark.read.format("eventbus").options(**opts).load()), n, runs
            )
        inferred = spark.read.parquet(*uris).schema
        result |= measure_alternated(
            {
                "typed_native": phased(lambda: read(spark, opts)),
                "plain_parquet": phased(lambda: spark.read.parquet(*uris)),
                "plain_parquet_schema": phased(lambda: spark.read.schema(inferred).parquet(*uris)),
            },
            n,
            max(runs, NATIVE_RUNS),
            NATIVE_WARMUP,
        )
        if "python" in only:
            result["typed_native"]["vs_typed_python"] = round(
                result["typed_native"]["events_per_s"] / result["typed_agg"]["events_per_s"], 2
            )
        native_rate = result["typed_native"]["events_per_s"]
        result["native_docs_forms"] = {
            "setting": DOCS_SETTING,
            "model": MODEL,
            "path": path_of(lambda: read(spark, opts)),
        }
        if "bounded" in only:
            result["bounded_native"] = bounded(spark, store, opts, files, runs, phased)
        streams = (
            ("stream_available_now", None, stream_run),
            ("stream_available_now_100k", 100_000, stream_run),
            ("stream_python_available_now", None, python_stream_run),
        )
        for name, limit, how in streams if "stream" in only else ():
            try:
                result[name] = measure(how(spark, opts, limit, args.stream_sink), n, runs)
            except SystemExit as exc:  # rows lost: said in the result, the other reads still run
                result[name] = {"error": str(exc), "events_per_s": None}
                result[name]["max_offsets_per_trigger"] = limit
                continue
            result[name]["max_offsets_per_trigger"] = limit
            result[name]["ratio_typed_native"] = round(
                result[name]["events_per_s"] / native_rate, 3
            )
        if "python" in only:
            import duckdb

            glob = f"{store}/bench-a/*/*.parquet"
            query = f"SELECT count(*), sum(dep_delay) FROM read_parquet('{glob}', union_by_name=1)"
            result["duckdb_typed"] = measure(
                lambda: int(duckdb.sql(query).fetchall()[0][0]), n, runs
            )
            result["offload_us_per_event"] = offload_cost("bench-a", min(n, 50_000), runs)

            result["raw"] = measure(source(), n, runs)
            result["typed"] = measure(source(model=MODEL), n, runs)
            result["typed_arrow"] = measure(source(model=MODEL, validate="false"), n, runs)
            for name in ("raw", "typed", "typed_arrow"):
                result[name]["vs_pyarrow"] = round(
                    result[name]["events_per_s"] / result["pyarrow"]["events_per_s"], 3
                )
                result[name]["vs_pyarrow_in_spark"] = round(
                    result[name]["events_per_s"] / result["pyarrow_in_spark"]["events_per_s"], 3
                )

        if "writer" in only:
            result["writer"] = writer_section(spark, url, rows, result["publish_many"], runs)

        if "evolution" in only:
            # schema evolution: a tenth more flights archived with `FlightV2` (a field added),
            # then the whole topic read natively as `FlightV2` (``source`` null in older segments)
            extra = rows[: max(1, n // 10)]
            anyio.run(publish_and_archive, url, "bench-a", extra, store, {EVENT_TYPE: EVOLVED})
            evolved = {**opts, "model": FlightV2}
            total = n + len(extra)
            result["native_after_evolution"] = {
                "path": path_of(lambda: read(spark, evolved)),
                **measure(phased(lambda: read(spark, evolved)), total, runs),
            }
            result["native_after_evolution"]["ratio_typed_native"] = round(
                result["native_after_evolution"]["events_per_s"] / native_rate, 3
            )
        result["targets"] = targets(result)
        spark.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
