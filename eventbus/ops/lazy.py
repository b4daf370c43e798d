"""A package's public names imported on first use (PEP 562): a process that imports one
submodule (a Spark worker unpickling ``eventbus.spark.writer``, a CLI command) does not pay for
the bus, the consumer and the Redis clients it does not use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    namespace: dict[str, Any], modules: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of the package whose globals are `namespace`: a name of
    `modules` (name -> the module defining it) is imported on its first lookup and kept in
    `namespace` (looked up once); any other name raises `AttributeError`. `__dir__` lists the
    globals and the package's ``__all__``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace["__all__"]})

    return __getattr__, __dir__
