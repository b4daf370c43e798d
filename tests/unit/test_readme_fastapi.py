"""The README's "Testing a FastAPI app" recipe runs as shown: its code blocks, each naming its file
on its first line (``# app.py``), are written to a folder byte for byte and pytest runs them in a
subprocess, with the eventbus plugin as users get it (in memory, no Redis)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_files(section: str) -> dict[str, str]:
    """The ``python`` code blocks of the README section titled `section`, by the file name
    their first line gives (``# name.py``). Raises `AssertionError` when the section is missing
    or a block names no file."""
    text = README.read_text()
    heading = f"\n## {section}\n"
    assert heading in text, f"README.md has no section {section!r}"
    start = text.index(heading) + len(heading)
    end = text.find("\n## ", start)
    files = {}
    for block in re.findall(r"^```python\n(.*?)^```$", text[start:end], re.S | re.M):
        first = block.partition("\n")[0]
        name = re.fullmatch(r"# (\w+\.py)", first)
        assert name, f"a code block of README section {section!r} names no file: {first!r}"
        files[name.group(1)] = block
    return files


def test_the_fastapi_testing_recipe_runs_as_shown(pytester: pytest.Pytester) -> None:
    files = readme_files("Testing a FastAPI app")
    assert sorted(files) == ["app.py", "test_app.py", "test_app_async.py"]
    for name, code in files.items():
        (pytester.path / name).write_text(code)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_app.py::test_an_order_is_invoiced PASSED*",
            "*test_app_async.py::test_an_order_is_billed*PASSED*",
        ]
    )
