"""Publishing from FastAPI, and answering a request/reply call (``pip install eventbus[fastapi]
uvicorn``)::

    uvicorn examples.fastapi_app:app

The bus is entered in the app's lifespan (`eventbus.fastapi.lifespan`) and reaches route handlers
as a dependency (`BusDep`). ``publish`` returns once Redis accepted the entry; it raises
`PayloadTooLarge` (answered 413) or `PublishError` (503: Redis did not confirm within
``publish_timeout_s``).
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException

from eventbus import PayloadTooLarge, PublishError
from eventbus.fastapi import BusDep, lifespan
from examples.orders_service import OrderPlaced, bus

app = FastAPI(lifespan=lifespan(bus))


@app.post("/orders", status_code=202)
async def place_order(order: OrderPlaced, bus: BusDep) -> dict[str, str]:
    try:
        entry_id = await bus.publish("orders", order, resource_id=order.order_id)
    except PayloadTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except PublishError as exc:
        raise HTTPException(503, str(exc)) from None
    return {"entry_id": entry_id}
