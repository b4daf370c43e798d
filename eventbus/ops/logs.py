"""Logging for ``eventbus run``: the standard `logging` module, configured once per process.

Three ways, chosen by `configure`:

* ``text`` (default): on a terminal, rich's handler (colours, wrapped lines); otherwise (a file,
  a pipe, a container's log collector) one line per record,
  ``2025-01-31T12:00:00.123Z WARNING eventbus.consumer: message``, with the newlines of the
  message and of its traceback escaped as ``\\n`` so that one record never spans two lines;
* ``json``: one JSON object per line (`JsonFormatter`): ``ts``, ``level``, ``logger``,
  ``message``, ``pid``, ``exc`` (the traceback, if any) and the record's ``extra`` fields;
* a ``logging.config.dictConfig`` file (``--log-config``): JSON, TOML, or YAML when PyYAML is
  installed. It replaces the two above; `JsonFormatter` and `OneLineFormatter` can be named in it
  (``"()": "eventbus.ops.logs.JsonFormatter"``).

Whichever it is, every handler gets `SecretsFilter`: the passwords of the Redis URLs this process
uses are replaced by ``***`` in messages and tracebacks, and control characters are escaped.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

from eventbus.errors import ConfigError
from eventbus.ops.log_context import HandlerLogFilter
from eventbus.ops.terminal import console, terminal_safe

LogFormat = Literal["text", "json"]

# attributes every LogRecord has: the others come from ``extra={...}``
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class SecretsFilter(logging.Filter):
    """Scrubs known Redis passwords and escapes control characters (newlines kept: the
    formatter decides) in a record's message and traceback; the message is formatted once."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = terminal_safe(record.getMessage(), newlines=True)
        record.args = ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = terminal_safe(record.exc_text, newlines=True)
        return True


def _iso(created: float) -> str:
    ms = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


class OneLineFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <logger>: <message>``, newlines (of the traceback too) escaped."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        exc = record.exc_text or (self.formatException(record.exc_info) if record.exc_info else "")
        if exc:
            line += "\n" + exc
        return line.replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    ``pid``, ``exc`` when there is a traceback, then the record's ``extra`` fields (values that
    JSON cannot hold are written as their ``str``)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        exc = record.exc_text or (self.formatException(record.exc_info) if record.exc_info else "")
        if exc:
            out["exc"] = exc
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        return json.dumps(out, default=str, ensure_ascii=False)


def load_config(path: str | Path) -> dict[str, Any]:
    """The dictConfig mapping in `path`, by extension: ``.json``, ``.toml``, ``.yaml``/``.yml``;
    ``version`` defaults to 1 and ``disable_existing_loggers`` to false.

    Raises `ConfigError` for a missing or unreadable file, an unknown extension, a file that does
    not parse, or a YAML file without PyYAML installed.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--log-config {p}: cannot read it: {exc.strerror or exc}") from None
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigError(
                    f"--log-config {p}: YAML needs PyYAML (pip install pyyaml); "
                    "or write the configuration as JSON or TOML"
                ) from None
            data = yaml.safe_load(text)
        else:
            raise ConfigError(
                f"--log-config {p}: unknown format {suffix or '(no extension)'!r}: "
                "use .json, .toml, .yaml or .yml"
            )
    except ConfigError:
        raise
    except Exception as exc:  # JSONDecodeError, TOMLDecodeError, yaml.YAMLError
        raise ConfigError(f"--log-config {p}: does not parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--log-config {p}: expected a mapping (dictConfig), got {data!r}")
    data.setdefault("version", 1)
    # eventbus's loggers exist before the file is read (module-level getLogger): dictConfig's
    # default would silence them
    data.setdefault("disable_existing_loggers", False)
    return data


def configure(
    *,
    level: str = "info",
    fmt: LogFormat = "text",
    config_file: str | Path | None = None,
    tty: bool | None = None,
) -> None:
    """Configure the root logger for a process (see the module docstring).

    :param level: a level name (``debug``, ``info``, ...), for `fmt`; a `config_file` sets its own
    :param fmt: ``text`` (rich on a terminal, one line per record otherwise) or ``json``
    :param config_file: a dictConfig file (JSON, TOML, YAML); replaces `level` and `fmt`
    :param tty: whether stderr is a terminal (default: asked of stderr)
    :raises ConfigError: for an unknown level or format, or a bad `config_file`
    """
    if config_file is not None:
        try:
            logging.config.dictConfig(load_config(config_file))
        except ValueError as exc:  # dictConfig's errors name the part that is wrong
            raise ConfigError(f"--log-config {config_file}: {exc}") from None
        _add_filter_everywhere()
        return
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"unknown log level {level!r} (debug, info, warning, error, critical)")
    if tty is None:
        tty = sys.stderr.isatty()
    handler: logging.Handler
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        handler.addFilter(
            HandlerLogFilter(outside=None)
        )  # the entry, when bus.middleware(log_context)
    elif fmt == "text" and tty:
        from rich.logging import RichHandler

        handler = RichHandler(console=console)
        handler.setFormatter(logging.Formatter("%(message)s"))
    elif fmt == "text":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(OneLineFormatter())
    else:
        raise ConfigError(f"unknown log format {fmt!r} (text, json)")
    handler.addFilter(SecretsFilter())
    logging.basicConfig(level=numeric, handlers=[handler], force=True)


def _add_filter_everywhere() -> None:
    """Give every configured handler a `SecretsFilter` (once)."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if not any(isinstance(f, SecretsFilter) for f in handler.filters):
                handler.addFilter(SecretsFilter())


def child_args(level: str, fmt: LogFormat, config_file: str | None) -> list[str]:
    """The ``eventbus run`` options that give a child process this process's logging."""
    args = ["--log-level", level, "--log-format", fmt]
    if config_file is not None:
        args += ["--log-config", os.path.abspath(config_file)]
    return args
