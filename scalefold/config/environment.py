"""Process environment variables set for the length of a block (the one helper for that)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_env(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (``None``: left as it is), the old value (or its
    absence) restored afterwards."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


__all__ = ["scoped_env"]
