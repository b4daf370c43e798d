"""The shop's web app: ``uvicorn examples.shop.app:app`` (see the package docstring).

`lifespan(bus, subscribers=True)` enters the bus on the server's event loop and runs the
handlers of `service.py` in this process until shutdown. The orders table lives in the database
at ``SHOP_DATABASE_URL`` (default: ``shop.db`` in the working directory).

The bus raises its own errors, never redis-py's; two become answers: `PublishError` (Redis did
not confirm within ``publish_timeout_s``: a restart longer than that) a 503, `RequestTimeout` (no
reply in time) a 504. From ``POST /orders`` a 503 comes after the row was committed: the order
exists without its event (docs/semantics.md, "Publish after commit", says why and what to do).
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from eventbus import PublishError, RequestTimeout
from eventbus.fastapi import BusDep, lifespan
from eventbus.outbox import AfterCommit
from examples.shop.service import (
    OrderCancelled,
    OrderPlaced,
    PriceChanged,
    Quote,
    QuoteRequested,
    bus,
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    sku: Mapped[str]
    quantity: Mapped[int]


engine = create_engine(os.environ.get("SHOP_DATABASE_URL", "sqlite:///shop.db"))
Base.metadata.create_all(engine)
Sessions = sessionmaker(engine)
after_commit = AfterCommit(bus)  # events queued in a transaction are published once it commits
after_commit.listen(Sessions)

app = FastAPI(lifespan=lifespan(bus, subscribers=True))


@app.exception_handler(PublishError)
async def publish_failed(request: Request, exc: PublishError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=503)


@app.exception_handler(RequestTimeout)
async def no_reply(request: Request, exc: RequestTimeout) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=504)


@app.post("/orders", status_code=201)
def place_order(order: OrderPlaced) -> dict[str, str]:  # a plain def: run in a worker thread
    with Sessions() as session, session.begin():
        session.add(Order(id=order.order_id, sku=order.sku, quantity=order.quantity))
        after_commit.publish(session, "orders", order, resource_id=order.order_id)
    # committed, then published: a rolled-back transaction publishes nothing
    return {"order_id": order.order_id}


@app.post("/orders/{order_id}/cancel", status_code=202)
async def cancel_order(order_id: str, bus: BusDep) -> dict[str, str]:
    entry_id = await bus.publish("orders", OrderCancelled(order_id=order_id), resource_id=order_id)
    return {"entry_id": entry_id}


class NewPrice(BaseModel):
    cents: int


@app.put("/prices/{sku}", status_code=202)
async def set_price(sku: str, price: NewPrice, bus: BusDep) -> dict[str, str]:
    event = PriceChanged(sku=sku, cents=price.cents)
    entry_id = await bus.publish("prices", event, resource_id=sku)
    return {"entry_id": entry_id}


@app.get("/quotes/{sku}")
async def get_quote(sku: str, quantity: int, bus: BusDep) -> Quote:
    request = QuoteRequested(sku=sku, quantity=quantity)
    return await bus.request("quotes", request, resource_id=sku, timeout_s=10, reply_model=Quote)
