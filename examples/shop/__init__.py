"""A shop: one small service combining what a real one uses (``pip install 'eventbus[fastapi]'
sqlalchemy uvicorn``).

- `service.py`: the events (typed pydantic models), the bus and its handlers: a consumer group
  declared on a `Router`, whose two handlers are routed by event type and publish a follow-up
  with ``ctx.publish``, a plain ``def`` handler (a worker thread) given its ledger by a
  dependency (``Depends``) and publishing with ``ctx.publish`` too, a publish middleware that
  stamps every outgoing event, a request handler answering ``bus.request`` and a broadcast
  subscriber that every running instance gets.
- `app.py`: the FastAPI app (`eventbus.fastapi.lifespan`): a sync ``def`` route writing a row
  with SQLAlchemy and publishing its event after the commit (`eventbus.outbox.AfterCommit`),
  async routes publishing, and a route calling ``bus.request``.

Everything in one process (Redis at REDIS_URL, default redis://127.0.0.1:6379/0)::

    uvicorn examples.shop.app:app

    curl -X PUT localhost:8000/prices/tea -H 'content-type: application/json' -d '{"cents": 350}'
    curl localhost:8000/quotes/tea?quantity=2
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
        -d '{"order_id": "o-1", "sku": "tea", "quantity": 2}'
    curl -X POST localhost:8000/orders/o-1/cancel

In production the web processes publish (``lifespan(bus)``, without ``subscribers=True``) and
``eventbus run examples.shop.service:bus --processes 2`` runs the handlers.
tests/integration/test_shop_example.py drives it against a redis-server restarted mid-run.
"""
