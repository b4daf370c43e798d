"""The import contracts of eventbus/ (``[tool.importlinter]`` in pyproject.toml: the layers of
docs/architecture.md, no circle between sibling modules, the consumer's Ownership apart from its
Pipeline) hold: `lint-imports` passes; and the modules and classes of the packages held to the
size rule stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout, proc.stdout[-2000:]


MAX_MODULE_LINES, MAX_CLASS_LINES = 350, 300
SMALL = [
    "eventbus",  # its top-level modules; the packages below are listed one by one
    "eventbus/cli",
    "eventbus/client",
    "eventbus/config",
    "eventbus/consumer",
    "eventbus/locking",
    "eventbus/ops",
    "eventbus/protocol",
    "eventbus/publishing",
    "eventbus/spark",
    "eventbus/testing",
    "eventbus/tier",
    "localredis",
]
"""The packages held to the size rule: every package of eventbus/, and localredis/."""


def test_modules_and_classes_stay_small() -> None:
    """A module does one job and a class holds one kind of state: no module of the packages in
    `SMALL` over `MAX_MODULE_LINES` lines, no class there over `MAX_CLASS_LINES`."""
    too_big = []
    for package in SMALL:
        folder = ROOT / package
        for path in sorted(folder.glob("*.py") if package == "eventbus" else folder.rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(ROOT)
            if len(text.splitlines()) > MAX_MODULE_LINES:
                too_big.append(f"{name}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    if size > MAX_CLASS_LINES:
                        too_big.append(f"{name}: class {node.name}, {size} lines")
    assert too_big == []
