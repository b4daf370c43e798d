"""``eventbus describe``: the contract read from an application's code, and its AsyncAPI 3.0
document validated against the official JSON schema (tests/fixtures/asyncapi, vendored from
@asyncapi/specs) with the `jsonschema` library, every reference resolved with `referencing`."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.exceptions
from pydantic import BaseModel
from rich.console import Console
from typer.testing import CliRunner

from eventbus import Context, EventBus, Settings
from eventbus.asyncapi import asyncapi_document
from eventbus.cli import app
from eventbus.cli.describe import tables
from eventbus.contract import contract_of
from eventbus.errors import ConfigError, InvalidEventType, ReservedEventType

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "fixtures/asyncapi/asyncapi-3.0.0.schema.json"
SCHEMA_SHA256 = "abe96881dbfaad495ccbb6bd8d3fb43ca18a13b9d7564849ccb66f39d5e5b20f"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    raw = SCHEMA_FILE.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "the vendored schema was changed"
    schema = json.loads(raw)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def assert_valid(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert errors == []
    resolver = referencing.Registry().resolver_with_root(referencing.Resource.opaque(doc))
    for ref in set(_refs(doc)):
        resolver.lookup(ref)  # raises referencing.exceptions.Unresolvable when it dangles


def test_the_example_apps_document_validates(
    validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        app, ["describe", "examples.orders_service:bus", "--asyncapi", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "billing" in result.output and "Invoiced" in result.output
    doc = json.loads(out.read_text())
    assert_valid(validator, doc)
    assert doc["asyncapi"] == "3.0.0"
    assert set(doc["channels"]) == {"orders", "invoices"}
    assert doc["channels"]["orders"]["address"] == "eventbus:stream:orders:{shard}"
    assert doc["channels"]["orders"]["x-eventbus"]["shards"] == 16
    billing = doc["operations"]["billing.bill"]
    assert billing["action"] == "receive"
    assert billing["x-eventbus"]["on_failure"] == "park"
    assert billing["x-eventbus"]["max_attempts"] == 5
    assert {m["$ref"] for m in billing["messages"]} == {
        "#/channels/orders/messages/OrderPlaced",
        "#/channels/orders/messages/OrderCancelled",
    }
    assert doc["operations"]["publish.invoices"]["action"] == "send"
    schema = doc["components"]["schemas"]["Invoiced"]
    assert schema["required"] == ["order_id", "total_cents"]
    assert schema["properties"]["total_cents"]["type"] == "integer"


def test_the_shop_examples_document_validates(
    validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    """examples/shop: broadcast, request/reply and two handlers of one group routed by type,
    declared on a router."""
    out = tmp_path / "shop.json"
    result = CliRunner().invoke(
        app, ["describe", "examples.shop.service:bus", "--asyncapi", str(out)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert_valid(validator, doc)
    assert set(doc["channels"]) == {
        "orders",
        "prices",
        "quotes",
        "quotes.replies",
        "shipments",
        "shipped",  # what the sync handler publishes with ctx.publish
    }
    # the fulfilment group's handlers, declared on a router, are in the document
    assert {"fulfilment.order_placed", "fulfilment.order_cancelled"} <= set(doc["operations"])
    assert doc["operations"]["_broadcast.price_changed"]["x-eventbus"]["broadcast"] is True
    # the request/reply handler's answer (it was left out of the document)
    reply = doc["operations"]["pricing.quote"]["reply"]
    assert reply["address"]["location"] == "$message.header#/eventbus-reply-to"
    assert reply["channel"] == {"$ref": "#/channels/quotes.replies"}
    assert reply["messages"] == [{"$ref": "#/channels/quotes.replies/messages/reply.Quote"}]
    assert doc["channels"]["quotes.replies"]["address"] is None
    assert doc["components"]["messages"]["reply.Quote"]["payload"] == {
        "$ref": "#/components/schemas/Quote"
    }
    fulfilment = {k: v for k, v in doc["operations"].items() if k.startswith("fulfilment.")}
    assert {k: [m["$ref"] for m in v["messages"]] for k, v in fulfilment.items()} == {
        "fulfilment.order_placed": ["#/channels/orders/messages/shop.order_placed"],
        "fulfilment.order_cancelled": ["#/channels/orders/messages/shop.order_cancelled"],
    }
    assert fulfilment["fulfilment.order_placed"]["x-eventbus"]["dedup_window_s"] == 86400


class Address(BaseModel):
    city: str


class Moved(BaseModel):
    """A customer moved."""

    customer: str
    to: Address
    previous: list[Address] = []


class Tick(BaseModel):
    __event_type__ = "clock.tick"
    n: int


def _rich_bus() -> EventBus:
    """Handlers of every kind: nested models, a union, an alias, a catch-all of raw payloads,
    a batch handler, a broadcast one, and a password in the Redis URL."""
    bus = EventBus(Settings(redis_url="redis://user:s3cret@db.internal:6390/3", shards=4))

    @bus.subscriber("customers", group="crm", type_name=["Moved", "Relocated"], dedup_window_s=60)
    async def moved(event: Moved, ctx: Context) -> None: ...

    @bus.subscriber("customers", group="crm", on_unknown="skip")
    async def anything(event: dict[str, Any]) -> None: ...

    @bus.subscriber("clock", group="stats", batch=True, max_batch=100)
    async def ticks(events: list[Tick]) -> None: ...

    @bus.subscriber("clock", broadcast=True)
    def each(event: Tick | Moved) -> None: ...

    bus.publishes("clock", Tick)
    return bus


def test_every_kind_of_handler_validates(validator: jsonschema.Draft7Validator) -> None:
    bus = _rich_bus()
    doc = asyncapi_document(
        contract_of(bus), keys=bus.keys, title="rich", redis_url=bus.settings.redis_url
    )
    assert_valid(validator, doc)
    assert "s3cret" not in json.dumps(doc) and "user" not in json.dumps(doc["servers"])
    assert doc["servers"]["redis"]["host"] == "db.internal:6390"
    assert set(doc["channels"]["customers"]["messages"]) == {"Moved", "Relocated", "any-event"}
    assert doc["components"]["schemas"]["Address"]["properties"]["city"]["type"] == "string"
    crm = doc["operations"]["crm.anything"]["x-eventbus"]
    assert (crm["on_unknown"], crm["dedup_window_s"]) == ("skip", 60)
    assert doc["operations"]["stats.ticks"]["x-eventbus"]["max_batch"] == 100
    assert doc["operations"]["_broadcast.each"]["x-eventbus"]["broadcast"] is True
    assert doc["components"]["messages"]["clock.tick"]["name"] == "clock.tick"


def test_the_validator_refuses_a_broken_document(validator: jsonschema.Draft7Validator) -> None:
    bus = _rich_bus()
    doc = asyncapi_document(contract_of(bus), keys=bus.keys, title="rich")
    doc["operations"]["stats.ticks"]["action"] = "subscribe"  # AsyncAPI 2's word, not 3's
    assert list(validator.iter_errors(doc))
    doc = asyncapi_document(contract_of(bus), keys=bus.keys, title="rich")
    doc["operations"]["stats.ticks"]["messages"] = [{"$ref": "#/channels/clock/messages/nope"}]
    with pytest.raises(referencing.exceptions.Unresolvable):
        assert_valid(validator, doc)


def test_tables_wrap_names_and_html_is_written(tmp_path: Path) -> None:
    out = tmp_path / "contract.html"
    result = CliRunner().invoke(
        app, ["describe", "examples.orders_service:bus", "--html", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "…" not in result.output  # names are folded, never cut
    assert "Declared publishers" in out.read_text() and "Invoiced" in out.read_text()


def test_html_with_asyncapi_is_the_documents_viewer_page(tmp_path: Path) -> None:
    doc_file, page_file = tmp_path / "doc.json", tmp_path / "doc.html"
    args = ["describe", "examples.orders_service:bus", "--asyncapi", str(doc_file)]
    result = CliRunner().invoke(app, [*args, "--html", str(page_file)])
    assert result.exit_code == 0, result.output
    page = page_file.read_text()
    [embedded] = re.findall(r'id="asyncapi-document">(.*?)</script>', page, re.S)
    assert json.loads(embedded) == json.loads(doc_file.read_text())
    assert "AsyncApiStandalone.render" in page
    assert "Declared publishers" not in page  # the tables stay on the console
    assert "Declared publishers" in result.output


def test_a_target_that_is_no_bus_is_one_line() -> None:
    result = CliRunner().invoke(app, ["describe", "examples.orders_service:ledger"])
    assert result.exit_code == 1
    assert "is not an EventBus" in result.output


def test_publisher_declarations_refuse_what_is_not_an_event() -> None:
    bus = EventBus()
    with pytest.raises(ConfigError, match="pydantic model"):
        bus.publishes("invoices")
    with pytest.raises(ConfigError, match="pydantic model"):
        bus.publishes("invoices", dict)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        bus.publishes("bad topic", Tick)

    class Sneaky(BaseModel):
        __event_type__ = "__eventbus.requeue"

    with pytest.raises(ReservedEventType):
        bus.publishes("invoices", Sneaky)
    bus.publishes("clock", Tick)
    bus.publishes("clock", Tick, Moved)
    assert bus.publications == {"clock": [Tick, Moved]}


def test_the_printed_event_types_show_their_schemas_fields() -> None:
    console = Console(width=200, record=True)
    for table in tables(contract_of(_rich_bus())):
        console.print(table)
    text = console.export_text()
    assert "customer: string, to: Address, previous?: array[Address]" in text
    assert "test_describe:Moved" in text and "raw payload (dict or bytes)" in text
    assert "batch <= 100" in text and "dedup 60 s" in text and "broadcast" in text
    assert re.search(r"│ clock +│ 4 +│ 1000000 +│ maxlen", text)  # topic, shards, cap, retention
    assert re.search(r"│ crm \(dedup 60 s.*│ after +│ 5 attempts, 0.1..10 s +│ continue", text)


class Spaced(BaseModel):
    __event_type__ = "order placed"


class Underscored(BaseModel):
    __event_type__ = "order_placed"


def test_an_event_type_name_with_a_space_colon_or_slash_is_refused() -> None:
    """``"order placed"`` and ``"order_placed"`` on one topic became one AsyncAPI message (one
    model's schema dropped), and nothing refused the space: subscribing, declaring and
    publishing such a type are `InvalidEventType` errors (a `ConfigError`)."""
    bus = EventBus()

    async def both(event: Spaced | Underscored) -> None: ...

    with pytest.raises(InvalidEventType, match=r"'order placed'.*1-200 characters"):
        bus.subscriber("orders", group="g")(both)
    with pytest.raises(InvalidEventType):
        bus.publishes("orders", Spaced)
    for name in ("a:b", "a/b", "x" * 201, "tab\there"):
        with pytest.raises(InvalidEventType):
            bus.publisher.encoder.prepare(
                bus.topic("orders"), type("Named", (BaseModel,), {"__event_type__": name})(), "r"
            )
    bus.publishes("orders", Underscored)  # a valid name
    assert bus.publisher.encoder.prepare(bus.topic("orders"), Underscored(), "r")[0]


def test_asyncapi_names_that_would_collide_are_a_config_error() -> None:
    """Valid names can still meet in the document: type ``a.b`` on topic ``x`` and ``b`` on
    topic ``x.a``, both qualified by their topic (other models on topic ``y`` take those
    types), make one message name. A `ConfigError` names both models instead of dropping
    one."""
    models = {
        name: type(name, (BaseModel,), {"__event_type__": etype, "__module__": __name__})
        for name, etype in (("Xab", "a.b"), ("XAb", "b"), ("Yab", "a.b"), ("Yb", "b"))
    }
    bus = EventBus()
    bus.publishes("x", models["Xab"])
    bus.publishes("x.a", models["XAb"])
    bus.publishes("y", models["Yab"], models["Yb"])
    with pytest.raises(ConfigError, match=r"message name 'x\.a\.b' would stand for both"):
        asyncapi_document(contract_of(bus), keys=bus.keys, title="t")


def test_describe_says_in_one_line_what_failed_in_the_application(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that raises at import, or a model pydantic has no JSON schema for, printed a
    full traceback: one line names the error and where it was raised, or the model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raising_app.py").write_text("x = 1\nraise RuntimeError('no config here')\n")
    (tmp_path / "opaque_app.py").write_text(
        "from pydantic import BaseModel, ConfigDict\n"
        "from eventbus import EventBus\n"
        "class Thing:\n    pass\n"
        "class Carried(BaseModel):\n"
        "    model_config = ConfigDict(arbitrary_types_allowed=True)\n"
        "    thing: Thing\n"
        "bus = EventBus()\n"
        "@bus.subscriber('t', group='g')\n"
        "async def handle(event: Carried) -> None: ...\n"
    )
    runner = CliRunner()
    raised = runner.invoke(app, ["describe", "raising_app:bus"])
    assert raised.exit_code == 1
    text = " ".join(raised.output.split())
    assert "importing raising_app failed: RuntimeError: no config here" in text
    assert "raising_app.py:2" in text and "Traceback" not in raised.output
    opaque = runner.invoke(app, ["describe", "opaque_app:bus"])
    assert opaque.exit_code == 1
    text = " ".join(opaque.output.split())
    assert "model opaque_app:Carried has no JSON schema" in text, text
    assert "Traceback" not in opaque.output


def test_asyncapi_dash_writes_the_document_to_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--asyncapi -`` wrote a file named ``-``: the document goes to stdout, the tables to
    stderr."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["describe", "examples.orders_service:bus", "--asyncapi", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["asyncapi"] == "3.0.0"
    assert "Consumers" in result.stderr
    assert not (tmp_path / "-").exists()
