"""Parsers for the raw input formats: mmCIF structures, MSAs (a3m / Stockholm / FASTA), HHsearch hits.

Every parser raises a subclass of :class:`ParseError` on bad input. The error names the offending
file (or chain) and carries a short machine-readable ``reason`` so that preprocessing can skip the
input, count skips per reason and keep going.
"""

from __future__ import annotations

from scalefold.errors import UserError


class ParseError(UserError, ValueError):
    """A raw input file (or one chain of it) cannot be used.

    Attributes:
        reason: short stable key for grouping in reports, e.g. ``"corrupt_mmcif"``.
        path: the file that was being parsed (``None`` for in-memory strings).
        detail: human-readable explanation.
    """

    def __init__(self, reason: str, detail: str, path: str | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.path = None if path is None else str(path)
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{detail} [{reason}]")

    def __reduce__(self):  # keep the attributes when sent between worker processes
        return (type(self), (self.reason, self.detail, self.path))


class MmcifError(ParseError):
    """An mmCIF file is corrupt, truncated, or has no usable protein chain."""


class MsaError(ParseError):
    """An alignment has invalid characters, a wrong query length, or no sequences."""


class HhrError(ParseError):
    """An HHsearch ``.hhr`` file cannot be parsed."""


__all__ = ["ParseError", "MmcifError", "MsaError", "HhrError"]
