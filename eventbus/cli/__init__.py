"""The ``eventbus`` command (typer + rich).

``run`` runs a service's subscribers (`eventbus.cli.run`); ``stats`` and ``tail``
(`eventbus.cli.inspect`), ``publish`` (`eventbus.cli.publish`), ``dlq`` (`eventbus.cli.dlq`),
``topic`` (`eventbus.cli.topic`: zstd dictionaries) and ``settings`` (`eventbus.cli.settings`:
the effective settings) are operator tools; ``describe`` (`eventbus.cli.describe`) prints the
application's contract and writes it as AsyncAPI; ``offload`` and
``replay`` drive the durable tier
(`eventbus.tier.cli`, registered when the tier extra is installed). Every command reads the same
settings as the library (``EVENTBUS_*``, ``REDIS_URL``), with ``--redis-url`` as an override
(`eventbus.cli.connection`).

What reaches the terminal is made safe (`eventbus.cli.output`): errors are one line with exit
code 1 (no traceback), passwords are redacted, and user data (resource IDs, group names, error
texts) has its control characters escaped and, in tables, its rich markup escaped
(`terminal_safe`, `cell`).
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from eventbus.cli.describe import describe
from eventbus.cli.dlq import dlq_app
from eventbus.cli.inspect import stats, tail
from eventbus.cli.output import cell, terminal_safe, user_errors
from eventbus.cli.publish import publish
from eventbus.cli.run import run
from eventbus.cli.settings import settings
from eventbus.cli.topic import topic_app

app = typer.Typer(no_args_is_help=True, help="Event-driven microservices on Redis Streams.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"eventbus {version('eventbus')}")
        raise typer.Exit


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Event-driven microservices on Redis Streams."""


app.command()(run)
app.command()(stats)
app.command()(tail)
app.command()(publish)
app.command()(settings)
app.command()(describe)
app.add_typer(dlq_app, name="dlq")
app.add_typer(topic_app, name="topic")


def _register_optional() -> None:
    """Commands living in modules with optional dependencies (the durable tier), registered when
    importable."""
    try:
        mod = importlib.import_module("eventbus.tier.cli")
    except ImportError:
        return
    mod.register(app)


_register_optional()


def main() -> None:
    app()


__all__ = ["app", "cell", "main", "terminal_safe", "user_errors"]
