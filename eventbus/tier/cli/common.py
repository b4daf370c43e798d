"""What the tier commands share: the ``--store`` option, the settings, opening the store, and
one-line errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from eventbus.config import Settings
from eventbus.ops.terminal import console as console  # shared by the tier commands
from eventbus.ops.terminal import terminal_safe
from eventbus.tier.settings import TierSettings

if TYPE_CHECKING:  # the commands import pyarrow and obstore only when they run
    from eventbus.tier.store import Store

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


def settings_of(redis_url: str | None) -> Settings:
    """The settings (environment, `redis_url` overriding); raises `ValidationError`."""
    return Settings(redis_url=redis_url) if redis_url else Settings()  # type: ignore[call-arg,unused-ignore]


def tier_settings(store_url: str | None, **overrides: Any) -> TierSettings:
    """The tier settings (environment, `store_url` and the `overrides` that are not None
    overriding)."""
    values = {k: v for k, v in overrides.items() if v is not None}
    if store_url:
        values["store_url"] = store_url
    return TierSettings(**values)


def open_tier_store(tier: TierSettings, *, create: bool = True) -> Store:
    """The store of `tier`; exits with one line when the tier extra is not installed."""
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


def command_setup(
    redis_url: str | None, store_url: str | None, *, create: bool = True, **overrides: Any
) -> tuple[Settings, TierSettings, Store]:
    """A tier command's settings (`settings_of`), tier settings (`tier_settings`) and store
    (`open_tier_store`), in that order. Raises `ValidationError` or `EventBusError`."""
    settings = settings_of(redis_url)
    tier = tier_settings(store_url, **overrides)
    return settings, tier, open_tier_store(tier, create=create)


def error_exit(exc: BaseException) -> typer.Exit:
    """One line on stderr (terminal-safe, passwords redacted), exit code 1."""
    console.print(f"[red]error:[/red] {escape(terminal_safe(exc))}", soft_wrap=True)
    return typer.Exit(1)
