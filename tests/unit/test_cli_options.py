"""`eventbus.ops.cli_options.output_file`: a command's output file that cannot be written is a
usage error naming the option, before the command does its work (``describe`` loaded the app
and printed its tables, ``replay`` read the archive, then failed on the directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eventbus.cli import app


@pytest.mark.parametrize(
    "args",
    [
        ["describe", "examples.orders_service:bus", "--html"],
        ["describe", "examples.orders_service:bus", "--asyncapi"],
        ["replay", "orders", "--no-progress", "--output"],
    ],
)
def test_a_directory_as_output_file_is_refused_before_the_command_runs(
    tmp_path: Path, args: list[str]
) -> None:
    result = CliRunner().invoke(app, [*args, str(tmp_path)])
    assert result.exit_code == 2, result.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # rich's panel, unwrapped
    assert f"Invalid value for '{args[-1]}'" in text and "is a directory" in text
    assert "Topics" not in text and "segments" not in text


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["run", "examples.orders_service:bus", "--metrics-port", "99999"], "--metrics-port"),
        (["run", "examples.orders_service:bus", "--metrics-port", "0"], "--metrics-port"),
        (["offload", "--once", "--metrics-port", "99999"], "--metrics-port"),
        (["offload", "--once", "--metrics-port", "0"], "--metrics-port"),
        (["tail", "orders", "--count", "0"], "--count"),
        (["dlq", "list", "orders", "billing", "--count", "-1"], "--count"),
        (["topic", "train-dict", "orders", "--sample", "0"], "--sample"),
        (["topic", "train-dict", "orders", "--size", "10"], "--size"),
        (["replay", "orders", "--shard", "-1"], "--shard"),
        (["replay", "orders", "--shard", "1024"], "--shard"),
    ],
)
def test_a_number_option_out_of_range_is_a_usage_error(args: list[str], option: str) -> None:
    """``eventbus run --metrics-port 99999`` ended in an `OverflowError` traceback once the
    server started; every number option is checked against its range before the command
    runs (exit code 2, the option named)."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())
    assert f"Invalid value for '{option}'" in text
