"""Publishing from a web handler.

Synchronous frameworks (Flask, Django): run the bus on its own event-loop thread with
``bus.sync()`` and publish from any request thread; calls from many threads share pipelines.
Needs Flask (``pip install flask``)::

    flask --app examples.web_handler:app run

Asynchronous frameworks (FastAPI, Starlette): enter the bus in the app's lifespan and await
``bus.publish`` in the handler::

    @asynccontextmanager
    async def lifespan(app):
        async with bus:
            yield

    @app.post("/orders")
    async def place(order: OrderPlaced) -> dict[str, str]:
        entry_id = await bus.publish("orders", order, resource_id=order.order_id)
        return {"entry_id": entry_id}

``publish`` returns once Redis accepted the entry; it raises `PayloadTooLarge` (answer 413) or
`PublishError` (answer 503: Redis did not confirm within ``publish_timeout_s``).
"""

from __future__ import annotations

import atexit
import contextlib
from typing import Any

from flask import Flask, request
from pydantic import ValidationError

from eventbus import PayloadTooLarge, PublishError
from examples.orders_service import OrderPlaced, bus

app = Flask(__name__)
_running = contextlib.ExitStack()
publisher = _running.enter_context(bus.sync())  # one event-loop thread for the process
atexit.register(_running.close)  # closing twice is harmless


@app.post("/orders")
def place_order() -> tuple[dict[str, Any], int]:
    try:
        order = OrderPlaced.model_validate(request.get_json(force=True))
    except ValidationError as exc:
        return {"error": exc.errors(include_url=False)}, 422
    try:
        entry_id = publisher.publish("orders", order, resource_id=order.order_id)
    except PayloadTooLarge as exc:
        return {"error": str(exc)}, 413
    except PublishError as exc:
        return {"error": str(exc)}, 503
    return {"entry_id": entry_id}, 202
