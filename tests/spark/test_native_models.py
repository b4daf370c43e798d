"""The native path as users reach it: segments matched to the read's models by what they hold
(every form of the offloader's setting with every form of the read's ``model``), a changed
column type an error, and bounded reads (``startingOffsets`` / ``endingOffsets`` /
``startingTimestamp``) read natively, rows equal to the Python source's."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from spark_support import Tick, Tock, offload, publish, ticks

from eventbus.errors import ConfigError
from eventbus.protocol.codec import decode_entry
from eventbus.spark import read
from eventbus.tier import open_store
from eventbus.tier.replay import iter_topic

pytestmark = pytest.mark.integration


def rows(df: Any) -> list[dict[str, Any]]:
    got = [r.asDict(recursive=True) for r in df.collect()]
    return sorted(got, key=lambda r: (r["topic"], r["shard"], r["entry_ms"], r["entry_seq"]))


def native(spark: Any, **options: Any) -> Any:
    """`read`, failing on any warning (a fallback to the Python source is one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return read(spark, **options)


def python(spark: Any, **options: str) -> Any:
    return spark.read.format("eventbus").options(**options).load()


def segments(store: str, topic: str) -> list[Path]:
    return list(Path(store).glob(f"{topic}/*/*.parquet"))


def test_every_offload_setting_form_reads_natively_with_every_read_form(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """docs/tier.md's setting (``"pkg:Model"`` or ``{"<event type>": "pkg:Model"}``) with
    docs/spark.md's ``model`` (a class, ``"pkg:Model"``, a mapping of paths or of classes): each
    pair reads every segment natively, rows equal to the Python source's."""
    store = str(tmp_path / "archive")
    settings = {f"{topic}-s": "spark_support:Tick", f"{topic}-m": {"Tick": "spark_support:Tick"}}
    for name, setting in settings.items():
        publish(redis_db, name, ticks(120))
        offload(redis_db, store, name, typed_models={name: setting})
    forms = [Tick, "spark_support:Tick", {"Tick": "spark_support:Tick"}, {"Tick": Tick}]
    for name in settings:
        want = rows(python(spark, store=store, topic=name, model="spark_support:Tick"))
        assert len(want) == 120
        for form in forms:
            df = native(spark, store=store, topic=name, model=form)
            assert len(df.inputFiles()) == len(segments(store, name)) > 1, (name, form)
            assert rows(df) == want, (name, form)


def test_a_topic_of_several_event_types_reads_natively_each_type_as_the_python_source(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Ticks and tocks offloaded with a model per type: a read of one type, of both, or of one
    model for every entry gives the Python source's rows (other types' typed columns and
    ``_corrupt`` null); the segments holding tocks are read by the Python source for the last
    (they have no typed values of every entry as `Tick`), said on the driver."""
    store = str(tmp_path / "archive")
    events: list[tuple[str, Any]] = [*ticks(80)]
    events += [(f"res-{i % 3}", Tock(resource=f"res-{i % 3}", n=i)) for i in range(40)]
    publish(redis_db, topic, events, shards=2)
    both = {"Tick": "spark_support:Tick", "Tock": "spark_support:Tock"}
    offload(redis_db, store, topic, shards=2, typed_models={topic: both})
    files = len(segments(store, topic))
    for model in ({"Tick": "spark_support:Tick"}, {"Tock": "spark_support:Tock"}, both):
        df = native(spark, store=store, topic=topic, model=model)
        assert len(df.inputFiles()) == files
        assert rows(df) == rows(python(spark, store=store, topic=topic, model=_text(model)))
    with pytest.warns(RuntimeWarning, match="through the Python source|the Python source:"):
        df = read(spark, store=store, topic=topic, model="spark_support:Tick")
    got = rows(df)
    assert got == rows(python(spark, store=store, topic=topic, model="spark_support:Tick"))
    assert sum(r["_corrupt"] is not None for r in got) == 40  # tocks are not ticks


def test_a_column_whose_type_changed_is_an_error_naming_it_and_the_segments(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(50), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:Tick"})
    publish(redis_db, topic, ticks(50, start=50), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:TickPriceText"})
    late = sorted(p.name for p in segments(store, topic))[-1]
    with pytest.raises(ConfigError, match=r"column 'price' is string in 1 segment\(s\)") as err:
        read(spark, store=store, topic=topic, model=Tick)
    assert late in str(err.value) and "double in the read's models" in str(err.value)


def test_bounded_reads_are_native_with_rows_filtered_inside_segments(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """``startingOffsets`` / ``endingOffsets`` (entry IDs inside segments) and
    ``startingTimestamp``: segments outside the bounds pruned, the others read natively and
    filtered to the bounds; rows equal to the Python source's."""
    store = str(tmp_path / "archive")
    ids = publish(redis_db, topic, ticks(400), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:Tick"})
    publish(redis_db, topic, ticks(30, start=400), shards=1)  # a Redis tail
    files = segments(store, topic)
    assert len(files) == 4
    base = {"store": store, "topic": topic, "redis_url": redis_db, "model": "spark_support:Tick"}
    start = f'{{"{topic}": {{"0": "{ids[149]}"}}}}'
    end = f'{{"{topic}": {{"0": "{ids[250]}"}}}}'
    ms = int(ids[320].split("-")[0])
    after_ms = sum(1 for f in files if int(f.stem.split("-")[2]) >= ms)
    cases = [
        ({"startingOffsets": start, "endingOffsets": end}, list(range(150, 251)), 2),
        ({"startingOffsets": start}, list(range(150, 430)), 3),
        ({"endingOffsets": end}, list(range(251)), 3),
        ({"startingTimestamp": str(ms)}, None, after_ms),
    ]
    for extra, seqs, read_files in cases:
        df = native(spark, **base, **extra)
        assert len([f for f in df.inputFiles() if f.endswith(".parquet")]) == read_files, extra
        got = rows(df)
        assert got == rows(python(spark, **base, **extra)), extra
        if seqs is not None:
            assert [r["seq"] for r in got] == seqs
        else:  # the first entry added at or after that ms, and all later ones
            first = min(i for i, x in enumerate(ids) if int(x.split("-")[0]) >= ms)
            assert [r["seq"] for r in got] == list(range(first, 430))


def test_a_bounded_read_pushes_its_time_range_to_the_parquet_scan(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """The bounds of a read inside segments reach Spark's Parquet reader as plain ``entry_ms``
    comparisons (pushed filters: row groups and pages outside them are skipped), not only as
    the per-shard condition Spark evaluates on every row of the segments."""
    store = str(tmp_path / "archive")
    ids = publish(redis_db, topic, ticks(200), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:Tick"})
    start = f'{{"{topic}": {{"0": "{ids[49]}"}}}}'
    end = f'{{"{topic}": {{"0": "{ids[150]}"}}}}'
    df = native(
        spark,
        store=store,
        topic=topic,
        model="spark_support:Tick",
        startingOffsets=start,
        endingOffsets=end,
    )
    plan = df._jdf.queryExecution().executedPlan().toString()
    pushed = plan.split("PushedFilters: [", 1)[1].split("]", 1)[0]
    # (the plan text cuts long values short: the upper bound's value is pinned by the unit test)
    assert f"GreaterThanOrEqual(entry_ms,{int(ids[49].split('-')[0])})" in pushed
    assert "LessThanOrEqual(entry_ms," in pushed
    assert [r["seq"] for r in rows(df)] == list(range(50, 151))


def test_bounded_reads_of_several_shards_and_topics_keep_each_shards_bounds(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """``subscribe`` of two topics of three shards, each shard bounded inside its segments
    (some shards of one topic only): read natively, each shard's rows within its own bounds,
    the unbounded shards whole; rows equal to the Python source's."""
    import json

    store = str(tmp_path / "archive")
    other = topic + "-b"
    for t in (topic, other):
        publish(redis_db, t, ticks(240), shards=3)
        offload(redis_db, store, t, shards=3, typed_models={t: "spark_support:Tick"})
    base = {"store": store, "subscribe": f"{topic},{other}", "model": "spark_support:Tick"}
    ids: dict[tuple[str, int], list[str]] = {}
    for r in rows(python(spark, **base)):
        ids.setdefault((r["topic"], r["shard"]), []).append(r["entry_id"])
    starts = {t: {str(s): ids[t, s][len(ids[t, s]) // 4] for s in (0, 1, 2)} for t in (topic,)}
    ends = {t: {str(s): ids[t, s][3 * len(ids[t, s]) // 4] for s in (1, 2)} for t in (topic,)}
    starts[other], ends[other] = {"2": ids[other, 2][10]}, {"0": ids[other, 0][-5]}
    bounds = {"startingOffsets": json.dumps(starts), "endingOffsets": json.dumps(ends)}
    df = native(spark, **base, **bounds)
    assert len([f for f in df.inputFiles() if f.endswith(".parquet")]) == len(
        segments(store, topic) + segments(store, other)
    )
    got = rows(df)
    assert got == rows(python(spark, **base, **bounds))
    for (t, s), all_ids in ids.items():
        lo = all_ids.index(starts[t][str(s)]) + 1 if str(s) in starts[t] else 0
        hi = all_ids.index(ends[t][str(s)]) + 1 if str(s) in ends[t] else len(all_ids)
        want = all_ids[lo:hi]
        assert [r["entry_id"] for r in got if (r["topic"], r["shard"]) == (t, s)] == want


def _text(model: dict[str, str]) -> str:
    import json

    return json.dumps(model)


def test_segments_written_before_the_models_are_read_by_the_python_source_the_rest_natively(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Segments without typed columns (archived before the topic's models were registered)
    need ``data`` decoded: the Python source reads those, Spark's reader the typed ones, and
    the driver is told once; rows equal to the Python source's."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(100), shards=1)
    offload(redis_db, store, topic, shards=1)
    old = segments(store, topic)
    publish(redis_db, topic, ticks(200, start=100), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: "spark_support:Tick"})
    typed = len(segments(store, topic)) - len(old)
    with pytest.warns(RuntimeWarning, match="1 of 3 segments have no typed columns") as said:
        df = read(spark, store=store, topic=topic, model=Tick)
    assert len(said) == 1
    assert len(df.inputFiles()) == typed == 2
    got = rows(df)
    assert got == rows(python(spark, store=store, topic=topic, model="spark_support:Tick"))
    assert [r["seq"] for r in got] == list(range(300))


def test_segments_that_leave_out_rebuilt_data_are_read_by_the_python_source_payload_intact(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Segments written with ``rebuild_data`` (version 3, docs/tier.md) hold no ``data`` for
    ticks: the native read sends them to the Python source, said on the driver, and every row's
    ``payload`` is the entry's bytes as published, equal to a read of segments that keep it."""
    kept, left_out = str(tmp_path / "kept"), str(tmp_path / "left-out")
    publish(redis_db, topic, ticks(90))
    publish(redis_db, f"{topic}-2", ticks(90))
    offload(redis_db, kept, topic, typed_models={topic: "spark_support:Tick"})
    setting = {f"{topic}-2": "spark_support:Tick"}
    offload(redis_db, left_out, f"{topic}-2", typed_models=setting, rebuild_data=True)
    with pytest.warns(RuntimeWarning, match="leave out the data their typed columns rebuild"):
        df = read(spark, store=left_out, topic=f"{topic}-2", model=Tick)
    got = rows(df)
    want = rows(native(spark, store=kept, topic=topic, model=Tick))
    assert len(got) == len(want) == 90
    assert all(r["payload"] for r in got)
    drop = ("topic", "entry_id", "entry_ms", "entry_seq", "event_id", "published_at", "payload")

    def same(r: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(v for k, v in sorted(r.items()) if k not in drop)

    # the same ticks, published twice: all but the IDs, times and envelope bytes agree
    assert sorted(map(same, got)) == sorted(map(same, want))
    payloads = [decode_entry({b"rid": b"r", b"type": b"Tick", b"data": r["payload"]}) for r in got]
    assert sorted(p.payload["seq"] for p in payloads) == sorted(r["seq"] for r in want)
    # byte for byte what the tier's own replay gives (tests/unit/test_rebuild.py: the bytes
    # that were in Redis)
    replayed = {
        (e.shard, str(e.entry_id)): e.data for e in iter_topic(open_store(left_out), f"{topic}-2")
    }
    assert {(r["shard"], r["entry_id"]): r["payload"] for r in got} == replayed
