"""``eventbus offload`` and ``eventbus replay``: registered on the root typer app by `register`.

Both read the same settings as the library (``EVENTBUS_*``, ``EVENTBUS_TIER_*``, ``REDIS_URL``,
the standard ``AWS_*`` variables for S3), with command-line options as overrides.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from eventbus.config import Settings
from eventbus.errors import EventBusError
from eventbus.tier.settings import TierSettings

if TYPE_CHECKING:  # the commands import pyarrow and obstore only when they run
    from eventbus.tier.replay import ArchivedEntry
    from eventbus.tier.store import Store

console = Console(stderr=True)

StoreUrl = Annotated[
    str | None,
    typer.Option(
        "--store",
        help="Segment store: folder path, file://, s3://bucket/prefix, memory:// "
        "(default EVENTBUS_TIER_STORE_URL, else ./eventbus-segments).",
    ),
]
RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Overrides REDIS_URL / EVENTBUS_REDIS_URL.")
]


def register(app: typer.Typer) -> None:
    """Add the ``offload`` and ``replay`` commands to `app` (the root ``eventbus`` app)."""
    app.command("offload")(offload)
    app.command("replay")(replay)


def _tier(store_url: str | None, **overrides: Any) -> TierSettings:
    values = {k: v for k, v in overrides.items() if v is not None}
    if store_url:
        values["store_url"] = store_url
    return TierSettings(**values)


def _open(tier: TierSettings, *, create: bool = True) -> Store:
    try:
        from eventbus.tier.store import open_store
    except ImportError as exc:
        console.print(
            f"[red]error:[/red] {exc}: install the tier extra (pip install eventbus[tier])"
        )
        raise typer.Exit(1) from None
    return open_store(
        tier.store_url, endpoint=tier.s3_endpoint, region=tier.s3_region, create=create
    )


def _error(exc: BaseException) -> typer.Exit:
    """One line on stderr (terminal-safe, passwords redacted), exit code 1."""
    from eventbus.cli import terminal_safe

    console.print(f"[red]error:[/red] {escape(terminal_safe(exc))}", soft_wrap=True)
    return typer.Exit(1)


def _checkpoint_counts(settings: Settings, topic: str, shards: list[int]) -> dict[int, int]:
    """Per shard, the entries the offloader checkpoint accounts for (``<shard>:count``).
    Raises `redis.exceptions.RedisError` / `OSError` when Redis cannot be asked."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from eventbus.keys import Keys

    key = Keys(settings.key_prefix, settings.hashtag).checkpoints(topic)
    with redis.Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=settings.redis_connect_timeout_s,
        socket_timeout=settings.redis_read_timeout_s,
        retry=Retry(NoBackoff(), 0),
    ) as client:
        values = client.hmget(key, [f"{s}:count" for s in shards])
    return {s: int(v) for s, v in zip(shards, values, strict=True) if v is not None}


def offload(
    topic: Annotated[
        list[str] | None, typer.Option("--topic", help="Topic to archive (repeat); default all.")
    ] = None,
    store: StoreUrl = None,
    once: Annotated[
        bool, typer.Option("--once", help="Archive everything now present, then exit.")
    ] = False,
    segment_max_entries: Annotated[int | None, typer.Option(min=1)] = None,
    segment_max_bytes: Annotated[int | None, typer.Option(min=1024)] = None,
    segment_max_age_s: Annotated[float | None, typer.Option(min=0)] = None,
    hot_window_s: Annotated[
        float | None, typer.Option(min=0, help="Archived entries younger than this stay.")
    ] = None,
    redis_url: RedisUrl = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Archive shard streams to segments (until SIGTERM/SIGINT, or with --once until caught up)."""
    from eventbus.app import connect

    logging.basicConfig(
        level=log_level.upper(), format="%(message)s", handlers=[RichHandler(console=console)]
    )
    settings = Settings(redis_url=redis_url) if redis_url else Settings()  # type: ignore[call-arg,unused-ignore]
    try:
        tier = _tier(
            store,
            segment_max_entries=segment_max_entries,
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=segment_max_age_s,
            hot_window_s=hot_window_s,
        )
        target = _open(tier)
    except EventBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1")

    from eventbus.tier.offloader import Offloader
    from eventbus.tier.store import describe

    async def main() -> None:
        redis = connect(settings)
        offloader = Offloader(redis, target, settings=settings, tier=tier, topics=topic)
        try:
            if once:
                stats = await offloader.run_until_caught_up()
            else:
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, stop)
                    await offloader.run(stop)
                    tg.cancel_scope.cancel()
                stats = offloader.stats
        finally:
            await redis.aclose()
        console.print(
            f"offloaded to {describe(target)}: {stats.segments} segments, {stats.entries} "
            f"entries, {stats.raw_bytes} raw bytes -> {stats.stored_bytes} stored bytes "
            f"(ratio {stats.compression_ratio:.2f}), {stats.adopted} adopted, "
            f"{stats.gaps} gaps ({stats.lost} entries lost)"
        )

    try:
        anyio.run(main)
    except EventBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


async def _stop_on_signal(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return


def parse_time_ms(value: str) -> int:
    """Unix milliseconds from ``<ms>`` or an ISO-8601 time (UTC when it has no offset)."""
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"not Unix ms nor an ISO-8601 time: {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def entry_json(entry: ArchivedEntry) -> dict[str, Any]:
    """One replayed entry as a JSON-able dict (payload decoded; ``error`` if it does not)."""
    out: dict[str, Any] = {
        "topic": entry.topic,
        "shard": entry.shard,
        "entry_id": str(entry.entry_id),
        "resource_id": entry.resource_id,
        "event_type": entry.event_type,
        "event_time_ms": entry.event_time_ms,
        "event_id": entry.event_id,
        "headers": entry.headers,
    }
    try:
        out["payload"] = entry.envelope().payload
    except EventBusError as exc:
        out["error"] = str(exc)
    return out


def replay(
    topic: Annotated[str, typer.Argument(help="Topic to replay.")],
    store: StoreUrl = None,
    since: Annotated[
        str | None, typer.Option(help="Entry time from (Unix ms or ISO-8601, inclusive).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Entry time until (Unix ms or ISO-8601, exclusive).")
    ] = None,
    from_id: Annotated[str | None, typer.Option(help="First entry ID (inclusive).")] = None,
    to_id: Annotated[str | None, typer.Option(help="Last entry ID (inclusive).")] = None,
    resource_id: Annotated[
        list[str] | None, typer.Option("--resource-id", help="Only this resource (repeat).")
    ] = None,
    event_type: Annotated[
        list[str] | None, typer.Option("--type", help="Only this event type (repeat).")
    ] = None,
    shard: Annotated[list[int] | None, typer.Option(help="Only this shard (repeat).")] = None,
    per_shard: Annotated[
        bool, typer.Option("--per-shard", help="Shard after shard instead of merged by ID.")
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write here instead of stdout (.parquet: Parquet)."),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.")] = True,
    allow_gaps: Annotated[
        bool,
        typer.Option(
            "--allow-gaps",
            help="Warn instead of failing when segments are missing from a shard's range.",
        ),
    ] = False,
    redis_url: RedisUrl = None,
) -> None:
    """Print a topic's archived events as JSON lines, or export them to Parquet.

    Events come in entry-ID order (merged across shards unless --per-shard), with a progress bar
    on stderr. A missing store or a topic with no segments is an error. Without an ID or time
    range, the entries read are checked against the offloader checkpoints in Redis (when
    reachable): a shard with fewer entries than its checkpoint accounts for (a deleted segment)
    fails the command after the replay (exit 1), or only warns with --allow-gaps.
    """
    from eventbus.keys import check_name

    try:
        check_name("topic", topic)
        settings = Settings(redis_url=redis_url) if redis_url else Settings()  # type: ignore[call-arg,unused-ignore]
        tier = _tier(store)
        source = _open(tier, create=False)
        from eventbus.tier.ids import parse_id
        from eventbus.tier.replay import ReplayFilter, iter_topic, plan
        from eventbus.tier.store import describe, list_shards_sync

        present = list_shards_sync(source, topic)
        if not present:
            raise EventBusError(
                f"no archived segments of topic {topic!r} in {describe(source)}: check the "
                "topic name and --store"
            )

        flt = ReplayFilter(
            start_id=parse_id(from_id) if from_id else None,
            end_id=parse_id(to_id) if to_id else None,
            since_ms=parse_time_ms(since) if since else None,
            until_ms=parse_time_ms(until) if until else None,
            resource_ids=frozenset(resource_id) if resource_id else None,
            event_types=frozenset(event_type) if event_type else None,
        )
        segments = plan(source, topic, flt, shard)
        whole = flt.start_id is None and flt.end_id is None and flt.since_ms is None
        whole = whole and flt.until_ms is None
        counts: dict[int, int] = {}
        total = sum(ref.size for refs in segments.values() for ref in refs)
        bar = Progress(
            TextColumn("[bold]replay {task.fields[topic]}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[events]} events"),
            TimeRemainingColumn(),
            console=console,
            disable=not progress,
        )
        with bar:
            task = bar.add_task("replay", total=total, topic=topic, events=0)
            entries = iter_topic(
                source,
                topic,
                flt,
                merge=not per_shard,
                segments=segments,
                on_segment=lambda ref: bar.update(task, advance=ref.size),
                counts=counts,
            )
            count = 0
            if output is not None and output.suffix == ".parquet":
                count = _write_parquet(output, entries, lambda n: bar.update(task, events=n))
            else:
                with output.open("w") if output else _stdout() as out:
                    for count, entry in enumerate(entries, 1):
                        out.write(json.dumps(entry_json(entry), default=str) + "\n")
                        if count % 10_000 == 0:
                            bar.update(task, events=count)
            bar.update(task, events=count)
        console.print(f"replayed {count} events of {topic} from {describe(source)}")
        if whole:
            _check_gaps(settings, source, topic, sorted(segments), counts, allow_gaps)
    except (EventBusError, ValidationError) as exc:
        raise _error(exc) from None


def _check_gaps(
    settings: Settings,
    source: Store,
    topic: str,
    shards: list[int],
    counts: dict[int, int],
    allow_gaps: bool,
) -> None:
    """Compare what replay read with the offloader checkpoints (see `replay`)."""
    from redis.exceptions import RedisError

    from eventbus.config import redact_url
    from eventbus.tier.replay import check_complete

    try:
        accounted = _checkpoint_counts(settings, topic, shards)
    except (RedisError, OSError) as exc:
        console.print(
            f"[yellow]warning:[/yellow] not checked for missing segments: Redis at "
            f"{escape(redact_url(settings.redis_url))} did not answer ({type(exc).__name__})",
            soft_wrap=True,
        )
        return
    gaps = check_complete(source, topic, counts, accounted)
    if gaps and not allow_gaps:
        raise gaps[0]
    for gap in gaps:
        console.print(f"[yellow]warning:[/yellow] {escape(str(gap))}", soft_wrap=True)


class _stdout:
    """`sys.stdout` as a context manager that does not close it."""

    def __enter__(self) -> Any:
        return sys.stdout

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()


def _write_parquet(path: Path, entries: Any, progress: Any, batch: int = 50_000) -> int:
    """Write entries with the segment schema (all topics' rows in one file); returns the count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eventbus.tier.segment import SCHEMA

    count = 0
    with pq.ParquetWriter(path, SCHEMA, compression="zstd") as writer:
        rows: list[ArchivedEntry] = []

        def flush() -> None:
            cols = {
                "topic": [e.topic for e in rows],
                "shard": [e.shard for e in rows],
                "entry_id": [str(e.entry_id) for e in rows],
                "entry_ms": [e.entry_id.ms for e in rows],
                "entry_seq": [e.entry_id.seq for e in rows],
                "resource_id": [e.resource_id for e in rows],
                "event_type": [e.event_type for e in rows],
                "event_time_ms": [e.event_time_ms for e in rows],
                "event_id": [e.event_id for e in rows],
                "headers": [None if e.headers is None else list(e.headers.items()) for e in rows],
                "data": [e.data for e in rows],
            }
            arrays = [pa.array(cols[f.name], f.type) for f in SCHEMA]
            writer.write_table(pa.Table.from_arrays(arrays, schema=SCHEMA))
            rows.clear()

        for entry in entries:
            rows.append(entry)
            count += 1
            if len(rows) >= batch:
                flush()
                progress(count)
        if rows:
            flush()
    return count
