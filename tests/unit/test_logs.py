"""eventbus.ops.logs: one line per record off a terminal, JSON lines, dictConfig files (JSON, TOML,
YAML), secrets scrubbed whatever the handler."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.logging import RichHandler

from eventbus.cli.output import remember_url
from eventbus.errors import ConfigError
from eventbus.ops import logs

URL = "redis://app:s3cret-pw@cache.internal:6379/0"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def _fail() -> None:
    try:
        raise RuntimeError(f"cannot reach {URL}\nsecond line")
    except RuntimeError:
        logging.getLogger("eventbus.test").exception("handler failed\non %s", URL)


def test_text_off_a_terminal_is_one_line_per_record_with_secrets_scrubbed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    remember_url(URL)
    logs.configure(level="info", fmt="text", tty=False)
    logging.getLogger("eventbus.test").debug("not shown")
    _fail()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert " ERROR eventbus.test: handler failed\\non redis://app:***@cache.internal" in line
    assert "Traceback (most recent call last)" in line and "RuntimeError" in line
    assert "s3cret" not in err


def test_json_lines_carry_extra_fields_and_the_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    remember_url(URL)
    logs.configure(level="debug", fmt="json", tty=True)  # json even on a terminal
    logging.getLogger("eventbus.test").info("took %d shards", 3, extra={"topic": "orders"})
    _fail()
    err = capsys.readouterr().err
    assert "s3cret" not in err
    first, second = (json.loads(line) for line in err.splitlines())
    assert first["message"] == "took 3 shards"
    assert first["level"] == "INFO" and first["logger"] == "eventbus.test"
    assert first["topic"] == "orders" and isinstance(first["pid"], int)
    assert first["ts"].endswith("Z") and "exc" not in first
    assert second["level"] == "ERROR" and "RuntimeError" in second["exc"]


def test_rich_only_on_a_terminal() -> None:
    logs.configure(fmt="text", tty=True)
    assert isinstance(logging.getLogger().handlers[0], RichHandler)
    logs.configure(fmt="text", tty=False)
    handler = logging.getLogger().handlers[0]
    assert not isinstance(handler, RichHandler)
    assert isinstance(handler.formatter, logs.OneLineFormatter)


def _dict_config(formatter: str) -> dict[str, object]:
    return {
        "version": 1,
        "formatters": {"j": {"()": formatter}},
        "handlers": {
            "err": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "j",
            }
        },
        "root": {"level": "WARNING", "handlers": ["err"]},
    }


def test_log_config_json_toml_and_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    remember_url(URL)
    config = _dict_config("eventbus.ops.logs.JsonFormatter")
    toml = (
        'version = 1\n[formatters.j]\n"()" = "eventbus.ops.logs.JsonFormatter"\n'
        '[handlers.err]\nclass = "logging.StreamHandler"\nstream = "ext://sys.stderr"\n'
        'formatter = "j"\n[root]\nlevel = "WARNING"\nhandlers = ["err"]\n'
    )
    files = {
        "log.json": json.dumps(config),
        "log.toml": toml,
        "log.yaml": yaml.safe_dump(config),
    }
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        assert logs.load_config(path) == {**config, "disable_existing_loggers": False}, name
        logs.configure(config_file=path)
        logging.getLogger("eventbus.test").info("below the file's level")
        logging.getLogger("eventbus.test").warning("connected to %s", URL)
        out = capsys.readouterr().err.splitlines()
        assert len(out) == 1, (name, out)
        assert json.loads(out[0])["message"] == "connected to redis://app:***@cache.internal:6379/0"


def test_yaml_without_pyyaml_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "log.yml"
    path.write_text("version: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ConfigError, match=r"YAML needs PyYAML \(pip install pyyaml\)"):
        logs.load_config(path)


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("log.ini", "[loggers]", "unknown format '.ini'"),
        ("log.json", "{", "does not parse"),
        ("log.json", "[1]", "expected a mapping"),
        ("missing.json", None, "cannot read it"),
    ],
)
def test_bad_log_config_files(tmp_path: Path, name: str, text: str | None, error: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        logs.configure(config_file=path)


def test_a_config_dictconfig_refuses_is_named_with_its_file(tmp_path: Path) -> None:
    path = tmp_path / "log.json"
    path.write_text(json.dumps({"version": 1, "root": {"handlers": ["nope"]}}))
    with pytest.raises(ConfigError, match=r"log\.json"):
        logs.configure(config_file=path)


def test_unknown_level_and_format() -> None:
    with pytest.raises(ConfigError, match="unknown log level"):
        logs.configure(level="chatty")
    with pytest.raises(ConfigError, match="unknown log format"):
        logs.configure(fmt="xml")  # type: ignore[arg-type]


def test_child_args_pass_the_config_file_as_an_absolute_path() -> None:
    args = logs.child_args("debug", "json", "conf/log.toml")
    assert args[:4] == ["--log-level", "debug", "--log-format", "json"]
    assert Path(args[5]).is_absolute() and args[5].endswith("conf/log.toml")
