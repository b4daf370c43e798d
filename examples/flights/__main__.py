"""``python -m examples.flights [ARGS]``: the flights pipeline's command line."""

import typer

from examples.flights.pipeline import main

if __name__ == "__main__":
    typer.run(main)
