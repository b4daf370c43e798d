"""``eventbus describe app:bus``: the application's contract, from its code (`eventbus.contract`):
topics, groups, handlers, event types, policies and declared publishers, as tables; with
``--asyncapi FILE`` also an AsyncAPI 3.0 document (`eventbus.asyncapi`); ``--html FILE`` writes
the tables as an HTML page, or with ``--asyncapi`` the document's viewer page
(`eventbus.asyncapi_view`). Nothing is read from Redis."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from eventbus.asyncapi import asyncapi_document, model_schema
from eventbus.asyncapi_view import asyncapi_html
from eventbus.cli.output import cell, user_errors
from eventbus.cli.run import load_bus
from eventbus.contract import Contract, GroupContract, contract_of
from eventbus.ops.cli_options import output_file
from eventbus.protocol.codec import event_type_of


def describe(
    target: Annotated[str, typer.Argument(help="module:attribute of the EventBus, e.g. app:bus")],
    asyncapi: Annotated[
        Path | None,
        output_file("Write the AsyncAPI 3.0 document (JSON) to this file ('-': stdout)."),
    ] = None,
    html: Annotated[
        Path | None,
        output_file(
            "Write an HTML page to this file: the tables, or with --asyncapi the document "
            "rendered by AsyncAPI's viewer."
        ),
    ] = None,
    title: Annotated[
        str | None, typer.Option(help="The document's title (default: TARGET).")
    ] = None,
    app_version: Annotated[str, typer.Option(help="The application's version.")] = "0.0.0",
) -> None:
    """Topics, consumer groups, handlers, event types and policies of an application.

    ``--asyncapi -`` writes the document to stdout (and the tables to stderr)."""
    with user_errors():
        bus = load_bus(target)
        contract = contract_of(bus)
        to_stdout = asyncapi is not None and str(asyncapi) == "-"
        console = Console(record=html is not None and asyncapi is None, stderr=to_stdout)
        for table in tables(contract):
            console.print(table)
        if asyncapi is not None:
            doc = asyncapi_document(
                contract,
                keys=bus.keys,
                title=title or target,
                version=app_version,
                redis_url=bus.settings.redis_url,
                profile=bus.profile,
            )
            text = json.dumps(doc, indent=2) + "\n"
            if to_stdout:
                sys.stdout.write(text)
            else:
                asyncapi.write_text(text)
                console.print(f"AsyncAPI 3.0 document written to {cell(asyncapi)}")
            if html is not None:
                html.write_text(asyncapi_html(doc))
                console.print(f"its HTML view written to {cell(html)}")
        elif html is not None:
            console.save_html(str(html))


def tables(contract: Contract) -> list[Table]:
    """The contract as rich tables: topics, consumers, event types, declared publishers."""
    topics = _table("Topics", "topic", "shards", "maxlen ~", "retention")
    for name, t in contract.topics.items():
        topics.add_row(cell(name), str(t.shards), str(t.maxlen), t.retention)
    groups = _table(
        "Consumers", "topic", "group", "handler", "event types", "ack", "retries", "on failure"
    )
    for g in contract.groups:
        for h in g.handlers:
            types = [t if m is not None else f"{t} (raw)" for t, m in h.events.items()]
            types += [f"any other ({h.raw or 'raw'})"] if h.catch_all else []
            groups.add_row(
                cell(g.topic.name),
                cell(_group(g)),
                cell(h.name),
                cell(", ".join(types)),
                g.ack,
                _retries(g),
                f"{g.on_failure}; unknown: {g.on_unknown}",
            )
    published = _table("Declared publishers", "topic", "event types")
    for name, models in contract.publishes.items():
        published.add_row(cell(name), cell(", ".join(event_type_of(m) for m in models)))
    events = _table(
        "Event types (JSON schema; ? marks optional)", "topic", "type", "model", "fields"
    )
    for name in contract.topics:
        for event_type, model in sorted(contract.models(name).items()):
            model_name = f"{model.__module__}:{model.__qualname__}"
            events.add_row(cell(name), cell(event_type), cell(model_name), cell(_fields(model)))
        if contract.takes_raw(name):
            events.add_row(cell(name), "any other", "-", "raw payload (dict or bytes)")
    return [topics, groups, events, published]


def _fields(model: type[BaseModel]) -> str:
    """The top-level fields of `model`'s JSON schema (pydantic's validation mode), one
    ``name: type`` each; ``--asyncapi`` writes the whole schema."""
    schema = model_schema(model)
    required = set(schema.get("required", []))
    props: dict[str, Any] = schema.get("properties", {})
    return ", ".join(f"{n}{'' if n in required else '?'}: {_type(p)}" for n, p in props.items())


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return str(prop["$ref"]).rpartition("/")[2]
    if "anyOf" in prop:
        return " | ".join(_type(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"array[{_type(prop.get('items', {}))}]"
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    return str(prop.get("type", "any"))


def _table(title: str, *columns: str) -> Table:
    """A table whose cells wrap rather than being cut (names are the point of it)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _group(g: GroupContract) -> str:
    extra = [
        "broadcast" if g.broadcast else "",
        f"batch <= {g.max_batch}" if g.max_batch else "",
        f"dedup {g.dedup_window_s:g} s" if g.dedup_window_s else "",
        f"timeout {g.handler_timeout_s:g} s" if g.handler_timeout_s else "",
    ]
    shown = [e for e in extra if e]
    return g.group + (f" ({', '.join(shown)})" if shown else "")


def _retries(g: GroupContract) -> str:
    r = g.retry
    return f"{r.max_attempts} attempts, {r.base_s:g}..{r.max_s:g} s"
