"""The Lua scripts in ``lua/``, loaded once and called with EVALSHA.

redis-py's `Script` object sends EVALSHA and, when Redis answers NOSCRIPT (after a restart or
``SCRIPT FLUSH``), loads the script and retries, so callers never see a flushed script cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent.parent  # the eventbus package
# In a wheel the scripts are packaged as eventbus/lua; in a source checkout they sit at lua/.
_LUA_DIRS = (_HERE / "lua", _HERE.parent / "lua")


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``. Raises `FileNotFoundError` naming the folders searched."""
    for folder in _LUA_DIRS:
        path = folder / f"{name}.lua"
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"{name}.lua not found in {', '.join(map(str, _LUA_DIRS))}")


def register(redis: Any, name: str) -> Any:
    """``lua/<name>.lua`` registered on `redis`: a redis-py script object, called as
    ``await script(keys=[...], args=[...])`` (EVALSHA, loading the script on NOSCRIPT).
    Raises `FileNotFoundError` when the file is missing."""
    return redis.register_script(source(name))


@dataclass(frozen=True)
class Scripts:
    """The registered scripts of one Redis client (`redis.asyncio.Redis` or `RedisCluster`):
    ``lua/lock_shards.lua`` and the others, or with ``prefix="verse_"`` the Verse profile's
    (``lua/verse_lock_shards.lua``, ...: `eventbus.locking.verse`)."""

    lock_shards: Any
    unlock_shards: Any
    heartbeat: Any

    @classmethod
    def register(cls, redis: Any, prefix: str = "") -> Scripts:
        return cls(
            lock_shards=register(redis, f"{prefix}lock_shards"),
            unlock_shards=register(redis, f"{prefix}unlock_shards"),
            heartbeat=register(redis, f"{prefix}heartbeat"),
        )
