"""``eventbus run --reload``: for development, run the service in a child process and restart
it whenever a Python file under the current directory changes (watchfiles, from the ``dev``
extra). The child is the same ``eventbus run`` without ``--reload``; a restart stops it as
SIGINT would (gracefully: its shard locks are released, so the new one takes them at once).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from typing import Any

from eventbus.errors import ConfigError


def child_command(argv: list[str]) -> list[str]:
    """The ``eventbus run`` command line of the child: `argv` (the arguments after
    ``eventbus``) without ``--reload``."""
    return [sys.executable, "-m", "eventbus.cli", *(a for a in argv if a != "--reload")]


def run_reloading(argv: list[str]) -> None:
    """Run ``eventbus <argv>`` (less ``--reload``) and restart it on every change of a ``.py``
    file under the current directory, until SIGINT or SIGTERM. Raises `ConfigError` when
    watchfiles is not installed."""
    try:
        import watchfiles
    except ImportError:
        raise ConfigError(
            "eventbus run --reload needs watchfiles: pip install 'eventbus[dev]'"
        ) from None

    def on_sigterm(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # run_process stops the child (SIGINT) and returns

    signal.signal(signal.SIGTERM, on_sigterm)
    command = shlex.join(child_command(argv))
    print(f"eventbus: --reload: running {command}, watching {os.getcwd()}", file=sys.stderr)
    watchfiles.run_process(
        os.getcwd(),
        target=command,
        target_type="command",
        watch_filter=watchfiles.PythonFilter(),
        callback=lambda changes: print(
            f"eventbus: --reload: {len(changes)} change(s), restarting", file=sys.stderr
        ),
    )
