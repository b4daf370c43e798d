"""What the ``eventbus`` commands put on the terminal, made safe.

User data (resource IDs, group names, error texts) has its control characters escaped
(`terminal_safe`) and, in rich tables or markup, its markup escaped too (`cell`); rich prints it
as it is (`data_console`: no ``:emoji:`` codes, no highlighting); every Redis URL
this process has seen (`remember_url`) has its secrets scrubbed from output and logs. Errors a
user can act on become one line on stderr and exit code 1, not a traceback (`user_errors`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from redis.exceptions import RedisError
from rich.markup import escape

from eventbus.client import loops
from eventbus.config import Settings
from eventbus.config.settings import env_name
from eventbus.errors import EventBusError
from eventbus.ops.terminal import console, data_console, remember_url, terminal_safe

T = TypeVar("T")
# Errors a user can act on: printed as one line, exit code 1
_USER_ERRORS = (EventBusError, RedisError, OSError, ValidationError)
__all__ = [
    "cell",
    "console",
    "data_console",
    "remember_url",
    "run_async",
    "terminal_safe",
    "user_errors",
]


def cell(text: object) -> str:
    """User data (a resource ID, a group name, an error) as a rich table cell or markup
    fragment: `terminal_safe`, with rich markup escaped."""
    return escape(terminal_safe(text))


def _message(exc: BaseException) -> str:
    """One line describing `exc`, safe for a terminal."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"]) or "settings"
            if exc.title == Settings.__name__ and env_name(where) in os.environ:
                where = env_name(where)  # what the user set: EVENTBUS_SHARDS, REDIS_URL
            parts.append(f"{where}: {err['msg']}")
        text = "invalid settings: " + "; ".join(parts)
    elif isinstance(exc, EventBusError):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return terminal_safe(text)


def _fail(exc: BaseException) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(_message(exc))}", soft_wrap=True)
    return typer.Exit(1)


def _leaf(exc: BaseException) -> BaseException | None:
    """The user error inside `exc` (itself, or the first one inside an exception group whose
    other members are only cancellations), or None."""
    if isinstance(exc, _USER_ERRORS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(_USER_ERRORS)
        if match is not None and rest is None:
            return _leaf(match.exceptions[0])
    return None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Errors a user can act on (bad settings or arguments, Redis unreachable or refusing,
    a shard-count mismatch, ...) become one line on stderr and exit code 1, not a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except BrokenPipeError:  # the reader of stdout left (``eventbus tail | head``): stop quietly
        # Python's recipe (the signal module's note on SIGPIPE): stdout to devnull, so that
        # the flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    except BaseException as exc:
        leaf = _leaf(exc)
        if leaf is None:
            raise
        raise _fail(leaf) from None


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`anyio.run` under `user_errors`, on uvloop when installed (`eventbus.client.loops`)."""
    with user_errors():
        return loops.run(fn, *args)
