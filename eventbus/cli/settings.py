"""``eventbus settings``: the settings eventbus reads in this environment, where each value came
from, and what it means (`eventbus.config.Settings`), passwords redacted."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from pydantic import SecretStr
from rich.table import Table

from eventbus.cli.connection import RedisUrl, settings_from
from eventbus.cli.output import cell, console, data_console, user_errors
from eventbus.config import Settings
from eventbus.config.settings import warn_unknown_variables
from eventbus.tier import settings as _tier_settings  # noqa: F401  (registers EVENTBUS_TIER_*)


def settings_rows(s: Settings, *, url_option: bool) -> list[dict[str, Any]]:
    """One row per field of `s`: ``setting``, ``env`` (its variable), ``value`` (JSON-ready,
    secrets redacted), ``source`` (``"--redis-url"``, ``"environment"`` or ``"default"``) and
    ``description``."""
    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(s, name)
        if name == "redis_url":
            value = s.redacted_url
        elif isinstance(value, SecretStr):
            value = "***"
        elif value is not None and not isinstance(value, bool | int | float | str):
            value = str(value)  # a Path
        source = "environment" if name in s.model_fields_set else "default"
        if name == "redis_url" and url_option:
            source = "--redis-url"
        env = f"EVENTBUS_{name.upper()}" + (" or REDIS_URL" if name == "redis_url" else "")
        rows.append(
            {
                "setting": name,
                "env": env,
                "value": value,
                "source": source,
                "description": " ".join((field.description or "").split()),
            }
        )
    return rows


def settings(
    redis_url: RedisUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """The settings eventbus reads here (EVENTBUS_*, REDIS_URL): value, source, meaning."""
    unknown = warn_unknown_variables(log=False)  # shown below, on the command's own output
    with user_errors():
        rows = settings_rows(settings_from(redis_url), url_option=bool(redis_url))
    for line in unknown:
        console.print(f"[yellow]warning:[/yellow] {cell(line)}", soft_wrap=True)
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table("setting", "value", "from", "meaning", title="eventbus settings")
    for row in rows:
        style = "bold" if row["source"] != "default" else None
        table.add_row(
            cell(row["setting"]),
            cell(row["value"]),
            cell(row["source"]),
            cell(row["description"]),
            style=style,
        )
    data_console().print(table)
