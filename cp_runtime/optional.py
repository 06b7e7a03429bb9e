"""Optional dependencies: a feature that needs an extra checks for it first, so a plain
install gets the pip command that adds it rather than a ModuleNotFoundError."""

from __future__ import annotations

import importlib

__all__ = ["MissingDependency", "require"]


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, feature: str, extra: str) -> None:
    """Raise MissingDependency unless `module` can be imported: `feature` (what the user asked
    for, e.g. "--executor ray") needs `pip install 'cp-runtime[extra]'`."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{feature} needs {module}, which is not installed: "
                                f"pip install 'cp-runtime[{extra}]'") from None
