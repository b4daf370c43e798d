"""``eventbus replay``: a topic's archived events as JSON lines or a Parquet file, checked for
missing segments against the offloader checkpoints."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from eventbus.config import MAX_SHARDS, Settings
from eventbus.errors import EventBusError
from eventbus.ops.cli_options import output_file
from eventbus.tier.cli.common import RedisUrl, StoreUrl, command_setup, console, error_exit
from eventbus.tier.cli.export import entry_json, stdout, write_parquet

if TYPE_CHECKING:
    from eventbus.tier.store import Store


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
    shard: Annotated[
        list[int] | None, typer.Option(min=0, max=MAX_SHARDS - 1, help="Only this shard (repeat).")
    ] = None,
    per_shard: Annotated[
        bool, typer.Option("--per-shard", help="Shard after shard instead of merged by ID.")
    ] = False,
    output: Annotated[
        Path | None,
        output_file("Write here instead of stdout (.parquet: Parquet).", "--output", "-o"),
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
    from eventbus.protocol.keys import check_name

    try:
        check_name("topic", topic)
        settings, _, source = command_setup(redis_url, store, create=False)
        from eventbus.protocol.ids import parse_id
        from eventbus.tier.replay import ReplayFilter, iter_topic, plan
        from eventbus.tier.store import describe, list_shards_sync

        flt = ReplayFilter(
            start_id=parse_id(from_id) if from_id else None,
            end_id=parse_id(to_id) if to_id else None,
            since_ms=parse_time_ms(since) if since else None,
            until_ms=parse_time_ms(until) if until else None,
            resource_ids=frozenset(resource_id) if resource_id else None,
            event_types=frozenset(event_type) if event_type else None,
        )
        whole = flt.start_id is None and flt.end_id is None and flt.since_ms is None
        whole = whole and flt.until_ms is None
        # the checkpoint counts before the store is listed: what the offloader commits after
        # only makes the archive look longer, never shorter (`check_complete`)
        accounted = _accounted(settings, topic, shard) if whole else None
        present = list_shards_sync(source, topic)
        if not present:
            raise EventBusError(
                f"no archived segments of topic {topic!r} in {describe(source)}: check the "
                "topic name and --store"
            )
        segments = plan(source, topic, flt, shard)
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
                count = write_parquet(output, entries, lambda n: bar.update(task, events=n))
            else:
                with output.open("w") if output else stdout() as out:
                    for count, entry in enumerate(entries, 1):
                        out.write(json.dumps(entry_json(entry), default=str) + "\n")
                        if count % 10_000 == 0:
                            bar.update(task, events=count)
            bar.update(task, events=count)
        console.print(f"replayed {count} events of {topic} from {describe(source)}")
        if accounted is not None:
            _check_gaps(source, topic, accounted, counts, allow_gaps)
    except (EventBusError, ValidationError) as exc:
        raise error_exit(exc) from None


def _accounted(settings: Settings, topic: str, only: list[int] | None) -> dict[int, int] | None:
    """`_checkpoint_counts`, or None (with a warning: nothing will be checked) when Redis does
    not answer."""
    from redis.exceptions import RedisError

    from eventbus.config.addresses import redact_url

    try:
        return _checkpoint_counts(settings, topic, only)
    except (RedisError, OSError) as exc:
        console.print(
            f"[yellow]warning:[/yellow] not checked for missing segments: Redis at "
            f"{escape(redact_url(settings.redis_url))} did not answer ({type(exc).__name__})",
            soft_wrap=True,
        )
        return None


def _check_gaps(
    source: Store,
    topic: str,
    accounted: dict[int, int],
    counts: dict[int, int],
    allow_gaps: bool,
) -> None:
    """Compare what replay read (`counts`) with what the offloader checkpoints accounted for
    before the store was listed (`accounted`, `_checkpoint_counts`): every shard they count,
    also one with no segment left in the store (its folder goes with its last object on S3, so
    a listing alone never sees it)."""
    from eventbus.tier.completeness import check_complete

    gaps = check_complete(source, topic, counts, accounted)
    if gaps and not allow_gaps:
        raise gaps[0]
    for gap in gaps:
        console.print(f"[yellow]warning:[/yellow] {escape(str(gap))}", soft_wrap=True)


def _checkpoint_counts(settings: Settings, topic: str, only: list[int] | None) -> dict[int, int]:
    """Per shard (every one the checkpoint hash has a count of, or `only` these), the entries
    the offloader checkpoint accounts for (``<shard>:count``), asked
    of Redis as the settings reach it (`eventbus.client.connection.connect`: a Cluster, the
    Sentinel primary, TLS; a plain client of ``redis_url`` missed the checkpoint hash on another
    Cluster node, ``MovedError``, and asked ``redis_url`` instead of the sentinels' primary).
    Raises `redis.exceptions.RedisError` / `OSError` when Redis cannot be asked."""
    import anyio

    from eventbus.client.connection import connect
    from eventbus.protocol.keys import Keys

    key = Keys.of(settings).checkpoints(topic)

    async def ask() -> dict[bytes, bytes]:
        client = connect(settings)
        try:
            return dict(await client.hgetall(key))
        finally:
            await client.aclose()

    counts: dict[int, int] = {}
    unrecorded: dict[int, int | None] = {}
    for field, value in anyio.run(ask).items():
        text, _, name = field.decode().partition(":")
        if not text.isdigit() or (only is not None and int(text) not in only):
            continue
        if name == "count":
            counts[int(text)] = int(value)
        elif name == "gap":  # accounted, its record not stored yet (docs/tier.md "Gaps")
            unrecorded[int(text)] = _lost_in(value, f"{key} {field.decode()}")
    for shard, lost in unrecorded.items():
        if lost is None:  # a loss of unknown size: this shard cannot be checked
            counts.pop(shard, None)
        elif shard in counts:
            counts[shard] -= lost
    return counts


def _lost_in(gap: bytes, where: str) -> int | None:
    """The entries an unrecorded gap (its record's JSON) lost, None if unknown. Raises
    `CorruptGapRecord` naming `where`."""
    from eventbus.tier.gaps import load_gap

    return load_gap(gap, where).lost_entries
