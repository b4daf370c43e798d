"""`Settings` of the process's environment, validated once per distinct environment."""

from __future__ import annotations

import os

from eventbus.config.settings import Settings, warn_unknown_variables

_read: tuple[tuple[tuple[str, str], ...], Settings] | None = None


def environment_settings() -> Settings:
    """``Settings()`` of the process's environment, validated once per distinct set of the
    variables it reads (``EVENTBUS_*`` and ``REDIS_URL``, any case, as pydantic-settings matches
    them): an `EventBus()` made per test or per request skips pydantic-settings' ~3-6 ms of
    environment parsing. Each call returns its own copy (a caller's change stays its own); an
    unknown ``EVENTBUS_*`` variable is warned as by ``Settings()``. Raises what ``Settings()``
    raises (`pydantic.ValidationError`)."""
    global _read
    seen = tuple(
        sorted(
            (name, value)
            for name, value in os.environ.items()
            if name.upper().startswith("EVENTBUS_") or name.upper() == "REDIS_URL"
        )
    )
    if _read is None or _read[0] != seen:
        _read = (seen, Settings())
    else:
        warn_unknown_variables()  # a family registered since (`register_variables`) is judged now
    return _read[1].model_copy()
