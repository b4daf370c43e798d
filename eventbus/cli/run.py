"""``eventbus run``: run the subscribers of an application's `EventBus`, in one process or
several."""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from functools import partial
from typing import Annotated, Any

import typer

from eventbus.app import EventBus
from eventbus.cli.output import remember_url, run_async, user_errors
from eventbus.errors import ConfigError
from eventbus.ops import logs
from eventbus.ops.children_metrics import ChildrenMetrics
from eventbus.ops.cli_options import port_option
from eventbus.ops.health import ChildrenHealth, Health, run_with_health, serve

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class LogFormatChoice(enum.StrEnum):
    text = "text"
    json = "json"


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
        raise ConfigError(f"{target}: importing {module_name} failed: {_raised(exc)}") from None
    except Exception as exc:  # the application's own error at import: one line, with its place
        raise ConfigError(f"{target}: importing {module_name} failed: {_raised(exc)}") from None
    bus = getattr(module, attr, None)
    if not isinstance(bus, EventBus):
        found = "nothing" if bus is None else type(bus).__name__
        raise ConfigError(f"{target} is not an EventBus (found {found})")
    return bus


def _raised(exc: BaseException) -> str:
    """``Type: message (file:line)``: an exception and the innermost place of its traceback."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run(
    target: Annotated[str, typer.Argument(help="module:attribute of the EventBus, e.g. app:bus")],
    processes: Annotated[int, typer.Option(min=1, help="Consumer processes to start.")] = 1,
    metrics_port: Annotated[
        int | None,
        port_option("Serve /metrics, /healthz and /readyz on this port (all processes)."),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(help="Address of the metrics port (0.0.0.0: every interface).")
    ] = "127.0.0.1",
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    log_format: Annotated[
        LogFormatChoice,
        typer.Option(help="text (rich on a terminal, one line per record otherwise) or json."),
    ] = LogFormatChoice.text,
    log_config: Annotated[
        str | None,
        typer.Option(help="logging dictConfig file (.json, .toml, .yaml); overrides the above."),
    ] = None,
    reload: Annotated[
        bool,
        typer.Option(
            "--reload", help="Development: restart when a .py file here changes (dev extra)."
        ),
    ] = False,
) -> None:
    """Run the subscribers of an EventBus until SIGTERM or SIGINT, then shut down gracefully."""
    if reload:
        from eventbus.cli.reload import run_reloading

        with user_errors():
            run_reloading(sys.argv[1:])
        return
    with user_errors():
        logs.configure(level=log_level, fmt=log_format.value, config_file=log_config)
    logging_args = logs.child_args(log_level, log_format.value, log_config)
    if processes > 1:
        with user_errors():
            _run_processes(target, processes, metrics_host, metrics_port, logging_args)
        return
    with user_errors():
        bus = load_bus(target)
        remember_url(bus.settings.redis_url)
        health = Health(lambda: bus.consumers)
        if metrics_port is not None:
            _serve(metrics_host, metrics_port, health)
    run_async(run_with_health, partial(bus.run, handle_signals=True), health)


def _serve(host: str, port: int, probe: Any, registry: Any = None) -> Any:
    """`eventbus.ops.health.serve` on `host`:`port`; raises `ConfigError` naming the port and
    the option to change when it cannot listen there (a port in use, an address not of this
    host), rather than the socket's bare `OSError`."""
    try:
        return serve(host, port, probe, registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {port}: cannot serve the metrics on {host}:{port} "
            f"({exc.strerror or exc}); pick another port with --metrics-port "
            f"(or another address with --metrics-host)"
        ) from None


def _run_processes(
    target: str, n: int, host: str, port: int | None, logging_args: list[str]
) -> None:
    """Start `n` single-process runs, forward SIGTERM/SIGINT to them (as SIGTERM), and serve
    the metrics of all of them (prometheus-client's multiprocess mode) with their health on
    `port`.

    A SIGINT is forwarded as SIGTERM: a ctrl-C in a terminal signals the whole foreground
    process group, children included, and a forwarded SIGINT would be each child's second one,
    which forces it (`eventbus.client.loops.stop_on_signal`); a repeated SIGTERM only asks again
    for the graceful shutdown under way. So one ctrl-C stops the children gracefully, a second
    one forces them, as it does a single process."""
    from prometheus_client import CollectorRegistry, multiprocess

    with contextlib.ExitStack() as stack:
        env = dict(os.environ)
        if port is not None and not env.get(MULTIPROC_ENV):
            env[MULTIPROC_ENV] = stack.enter_context(tempfile.TemporaryDirectory("-eventbus"))
        procs: list[subprocess.Popen[bytes]] = []
        if port is not None:  # first: a taken port fails before any child starts
            registry = CollectorRegistry()
            # a metric file a child is still creating is left out of a scrape, not a 500
            ChildrenMetrics(registry, path=env[MULTIPROC_ENV])
            server = _serve(host, port, ChildrenHealth(procs, registry), registry)
            stack.callback(server.shutdown)
            # with PROMETHEUS_MULTIPROC_DIR set by the user, this process (no bus, no tick)
            # wrote its own eventbus_ready and tick gauges there at import: 0, not a child's
            multiprocess.mark_process_dead(os.getpid(), env[MULTIPROC_ENV])  # type: ignore[no-untyped-call]
        cmd = [sys.executable, "-m", "eventbus.cli", "run", target, *logging_args]
        # for each signal, how many children it reached: one that comes while a child is
        # being started still reaches that child, and no further child is started (installed
        # after the children, a signal meanwhile killed this process and orphaned them)
        received: list[int] = []

        def forward(_signum: int, _frame: Any) -> None:
            received.append(len(procs))
            for p in procs:
                p.send_signal(signal.SIGTERM)  # (not SIGINT: see the docstring)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        while len(procs) < n and not received:
            child = subprocess.Popen(cmd, env=env)
            procs.append(child)  # from here, `forward` reaches it
            for reached in list(received):
                if reached < len(procs):  # (came during Popen: before the append)
                    child.send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            codes.append(p.wait())
            if port is not None:
                multiprocess.mark_process_dead(p.pid, env[MULTIPROC_ENV])  # type: ignore[no-untyped-call]
    if any(codes):  # a child killed by a signal has a negative code
        raise typer.Exit(1)
