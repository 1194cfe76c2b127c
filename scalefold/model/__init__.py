"""The AlphaFold2 model: ``AlphaFold`` and its configuration ``AlphaFoldConfig``.

Exports are resolved lazily, so importing a single module (e.g. ``scalefold.model.primitives``)
does not build the whole model's import graph.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AlphaFold": "scalefold.model.alphafold",
    "AlphaFoldConfig": "scalefold.model.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
