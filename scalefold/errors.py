"""Small helpers for error messages shared across the package."""

from __future__ import annotations


def exception_summary(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (``"TypeName"`` for an empty message): one exception
    in one log line, for messages that list several or embed one in a sentence."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


__all__ = ["exception_summary"]
