"""Configuration: `Settings` (read once from the environment, passed down as an object) and the
Redis addresses they hold (`eventbus.config.addresses`: URL checks, Sentinel addresses, and
passwords kept out of what is printed, logged or raised). The bottom layer: it imports nothing
else of eventbus.

The names below are imported on first use (PEP 562): a process that needs only
`eventbus.config.addresses` (Spark's stream planner, through the tier's store) does not import
pydantic-settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eventbus.config.environment import environment_settings
    from eventbus.config.settings import DECOMPRESSION_FACTOR, MAX_SHARDS, Settings

__all__ = ["DECOMPRESSION_FACTOR", "MAX_SHARDS", "Settings", "environment_settings"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'eventbus.config' has no attribute {name!r}")
    from eventbus.config import environment, settings

    globals()[name] = getattr(environment if name == "environment_settings" else settings, name)
    return globals()[name]
