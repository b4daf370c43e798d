"""Options that several commands take, as typer declares them (`eventbus.cli`, `eventbus.tier.cli`).
Only the commands import this module: the library does not import typer."""

from __future__ import annotations

from typing import Any

import typer


def port_option(help: str) -> Any:
    """A typer option taking a TCP port: 1-65535, a usage error (exit code 2) naming the
    option otherwise (99999 ended in an `OverflowError` traceback when the server started)."""
    return typer.Option(min=1, max=65535, help=help)


def output_file(help: str, *names: str) -> Any:
    """A typer option naming a file the command writes: ``Annotated[Path | None,
    output_file("Write ... to this file.")]``, with its `names` (default: from the parameter).
    Shown as ``FILE``; a directory, or an existing file that cannot be written, is a usage error
    naming the option (exit code 2) before the command runs, not an error once its work is
    done."""
    return typer.Option(*names, help=help, metavar="FILE", dir_okay=False, writable=True)
