"""``eventbus offload``: run the offloader (`eventbus.tier.offloader.Offloader`) until stopped,
or with ``--once`` until everything now in the streams is archived."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import anyio
import typer
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus.client.loops import stop_on_signal, young_gc_threshold
from eventbus.errors import ConfigError, EventBusError, RedisUnavailable
from eventbus.ops.cli_options import port_option
from eventbus.ops.logs import configure
from eventbus.tier.cli.common import RedisUrl, StoreUrl, command_setup, console, error_exit


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
        int | None, port_option("Serve Prometheus metrics on this port.")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Archive shard streams to segments (until SIGTERM/SIGINT, or with --once until caught up)."""
    from eventbus.client.connection import connect

    # as `eventbus run` does: secrets scrubbed, and the handlers of an earlier configuration in
    # this process (another command run in-process) replaced, not written to after they closed
    configure(level=log_level)
    try:
        settings, tier, target = command_setup(
            redis_url,
            store,
            segment_max_entries=segment_max_entries,
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=segment_max_age_s,
            hot_window_s=hot_window_s,
        )
    except (EventBusError, ValidationError) as exc:  # (ValidationError: a traceback before)
        raise error_exit(exc) from None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr="127.0.0.1")
        except OSError as exc:  # a port in use: was a traceback
            raise error_exit(ConfigError(f"--metrics-port {metrics_port}: {exc}")) from None

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
                    tg.start_soon(stop_on_signal, stop)
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
        # as `eventbus run` (Settings.gc_threshold), and the set-up's heap frozen
        with young_gc_threshold(settings.gc_threshold), _frozen_heap():
            anyio.run(main)
    except EventBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    except (RedisError, OSError) as exc:  # Redis unreachable or refusing: was a rich traceback
        down = isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError)
        raise error_exit(RedisUnavailable.of(settings, exc) if down else exc) from None


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """The offloader's process runs it alone: the objects of its imports and set-up (pyarrow,
    pandas, pydantic, redis: ~100k) leave the collected generations (`gc.freeze`), so that the
    full collections the offload's allocations trigger walk only its own objects (a quarter of
    its CPU before: docs/tier.md, "The offloader's process"). Process-wide, hence in the
    command and not in the library; unfrozen at the end, for a command run in-process."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
