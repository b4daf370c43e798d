"""Configuration: `Settings` (read once from the environment, passed down as an object) and the
Redis addresses they hold (`eventbus.config.addresses`: URL checks, Sentinel addresses, and
passwords kept out of what is printed, logged or raised). The bottom layer: it imports nothing
else of eventbus."""

from eventbus.config.environment import environment_settings
from eventbus.config.settings import DECOMPRESSION_FACTOR, MAX_SHARDS, Settings

__all__ = ["DECOMPRESSION_FACTOR", "MAX_SHARDS", "Settings", "environment_settings"]
