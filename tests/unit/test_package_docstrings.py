"""Package docstrings stay true after moves: every module a package's ``__init__`` docstring names
in backticks exists. A name counts as a module when it is dotted (`eventbus.cli.run`: it must
import) or a bare lower-case name (`lease`): then it must be a module or subpackage of that
package, or a name one of its modules defines at top level (`running`, `terminal_safe`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "eventbus"


_BACKTICKED = re.compile(r"(?<!`)`([A-Za-z_][\w.]*)`(?!`)")
_BARE_MODULE = re.compile(r"[a-z_][a-z0-9_]*")


def _defined(package: Path) -> set[str]:
    """Top-level names the package's modules define or import."""
    return _defined_in(package.rglob("*.py"))


def _defined_in(paths: Iterable[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names |= {(a.asname or a.name).partition(".")[0] for a in node.names}
    return names


def _resolves(dotted: str) -> bool:
    """`dotted` (``eventbus.x.y``) is a module or package, or a top-level name of one."""
    path = PACKAGES.parent.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return True
    owner = path.parent
    if owner.with_suffix(".py").is_file():
        return path.name in _defined_in([owner.with_suffix(".py")])
    return owner.is_dir() and path.name in _defined(owner)


def missing_modules(package: Path) -> list[str]:
    """The backticked names of `package`'s docstring that name no module of it (see above)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    defined = _defined(package)
    missing = []
    for name in dict.fromkeys(_BACKTICKED.findall(doc)):
        if name.startswith("eventbus."):
            if not _resolves(name):
                missing.append(name)
        elif _BARE_MODULE.fullmatch(name):
            is_module = (package / f"{name}.py").is_file() or (package / name).is_dir()
            if not is_module and name not in defined:
                missing.append(name)
    return missing


def _packages() -> list[object]:
    params: list[object] = []
    for init in sorted(PACKAGES.rglob("*/__init__.py")):
        name = init.parent.relative_to(PACKAGES).as_posix()
        params.append(pytest.param(init.parent, id=name))
    return params


@pytest.mark.parametrize("package", _packages())
def test_every_module_a_package_docstring_names_exists(package: Path) -> None:
    assert missing_modules(package) == []


def test_a_stale_name_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""Parts: `kept`, `gone`, `helper`, `Thing`."""\n')
    (package / "kept.py").write_text("def helper() -> None: ...\n")
    assert missing_modules(package) == ["gone"]
