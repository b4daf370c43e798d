"""``eventbus run``: run the subscribers of an application's `EventBus`, in one process or
several."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from typing import Annotated, Any

import typer

from eventbus.app import EventBus
from eventbus.cli.output import remember_url, run_async, setup_logging, user_errors
from eventbus.errors import ConfigError


def load_bus(target: str) -> EventBus:
    """Import ``module:attribute`` and return the `EventBus` it names; raises `ConfigError`
    (one line) when the module, the attribute or the bus is not there."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"expected module:attribute (e.g. app:bus), got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(
                f"{target}: no module named {exc.name!r} (run from the folder that holds it)"
            ) from None
        raise
    bus = getattr(module, attr, None)
    if not isinstance(bus, EventBus):
        found = "nothing" if bus is None else type(bus).__name__
        raise ConfigError(f"{target} is not an EventBus (found {found})")
    return bus


def run(
    target: Annotated[str, typer.Argument(help="module:attribute of the EventBus, e.g. app:bus")],
    processes: Annotated[int, typer.Option(min=1, help="Consumer processes to start.")] = 1,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port (first process).")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Run the subscribers of an EventBus until SIGTERM or SIGINT, then shut down gracefully."""
    if processes > 1:
        _run_processes(target, processes, metrics_port, log_level)
        return
    setup_logging(log_level)
    with user_errors():
        bus = load_bus(target)
        remember_url(bus.settings.redis_url)
        if metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(metrics_port, addr="127.0.0.1")
    run_async(lambda: bus.run(handle_signals=True))


def _run_processes(target: str, n: int, metrics_port: int | None, log_level: str) -> None:
    """Start `n` single-process runs and forward SIGTERM/SIGINT to them."""
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "eventbus.cli", "run", target, "--log-level", log_level]
        if metrics_port is not None and i == 0:
            cmd += ["--metrics-port", str(metrics_port)]
        procs.append(subprocess.Popen(cmd))

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    if any(codes):  # a child killed by a signal has a negative code
        raise typer.Exit(1)
