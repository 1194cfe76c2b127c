"""Errors a user can cause, and small helpers for error messages shared across the package.

Every ``scalefold`` subcommand ends a mistake in its input or environment (a missing or unreadable
file, a directory where a file was expected, a file of the wrong format, an output location that
cannot be written, a value out of range) the same way: exit status :data:`EXIT_USER_ERROR` (3) and a
one- or two-line message naming the offending path or option and what was expected -- no traceback
(``--debug`` or ``SCALEFOLD_DEBUG=1`` shows it). Usage errors argparse catches keep its status 2.

Every error a user can cause is a :class:`UserError`: a subclass in the unit that raises it (a parse
error, a checkpoint error, a parallel layout the launch cannot hold, ...), which may say how it is
introduced (:attr:`UserError.label`: ``scalefold train: checkpoint error: ...``), how many lines of it
are shown and a second line of advice. The one top-level handler in :mod:`scalefold.cli` catches
:class:`UserError` -- and ``OSError`` with a file name, the standard library's own "this path cannot be
used" -- and prints :func:`user_error_message`. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

EXIT_USER_ERROR = 3
MAX_MESSAGE_LINES = 2


class UserError(Exception):
    """A mistake in the user's input or environment; the message names the input and what was expected.

    A subclass (or one raise) may set :attr:`label` (the words before the message; empty: none),
    :attr:`max_lines` (of the message shown; None: all) and :attr:`hint` (a second line of advice).
    """

    #: ``scalefold COMMAND: <label>: <message>``
    label: str = "error"
    #: lines of the message shown (None: every line, e.g. one per file that could not be loaded)
    max_lines: int | None = MAX_MESSAGE_LINES
    #: one more line after the message, or None
    hint: str | None = None

    def __init__(self, *args: object, label: str | None = None, hint: str | None = None) -> None:
        super().__init__(*args)
        if label is not None:
            self.label = label
        if hint is not None:
            self.hint = hint

_OS_ERROR_EXPECTATIONS = {
    errno.ENOENT: "does not exist",
    errno.EISDIR: "is a directory, expected a file",
    errno.ENOTDIR: "is not a directory (a path component is a file)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "no space left on the device",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "the file name is too long",
}


def exception_summary(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (``"TypeName"`` for an empty message): one exception
    in one log line, for messages that list several or embed one in a sentence."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _message_text(exc: BaseException) -> str:
    # KeyError's str() is the repr of its argument (stray quotes): use the argument itself.
    text = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else exc
    return str(text).strip()


# PyTorch's text for a file torch.load(weights_only=True) refuses: advice to load it unsafely, an issue
# link, the unpickler's opcode; several lines, ending with the documentation link.
_TORCH_WEIGHTS_ONLY_ADVICE = re.compile(r"Weights only load failed\..*?torch\.load\.html\.?", re.DOTALL)
_TORCH_ADVICE_REPLACEMENT = "not a checkpoint of tensors and plain containers (torch.load refused it)"


def shorten(text: str, max_lines: int | None = MAX_MESSAGE_LINES) -> str:
    """``text`` without PyTorch's ``weights_only`` advice (how to load an untrusted file unsafely: never
    the remedy for a wrong input file), and at most ``max_lines`` non-empty lines (None: all)."""
    text = _TORCH_WEIGHTS_ONLY_ADVICE.sub(_TORCH_ADVICE_REPLACEMENT, text)
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] += " ..."
    return "\n".join(lines)


def user_error_message(exc: BaseException) -> str | None:
    """The short message for an error caused by the user's input or environment (a :class:`UserError`, or an
    ``OSError`` naming a file), None for anything else."""
    if isinstance(exc, UserError):
        return shorten(_message_text(exc), exc.max_lines)
    if isinstance(exc, OSError) and exc.filename is not None:
        expected = _OS_ERROR_EXPECTATIONS.get(exc.errno or -1, exc.strerror or type(exc).__name__)
        return shorten(f"{os.fsdecode(exc.filename)}: {expected}")
    return None


# -- checks of input and output paths: one phrasing for every subcommand -----------------------------


def require_file(path: str | os.PathLike[str], what: str, expected: str = "a file") -> Path:
    """``path`` as a :class:`Path` if it is a readable, non-empty file, else :class:`UserError`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} does not exist (expected {expected})")
    if p.is_dir():
        raise UserError(f"{what} {p} is a directory (expected {expected})")
    if not p.is_file():
        raise UserError(f"{what} {p} is not a regular file (expected {expected})")
    if not os.access(p, os.R_OK):
        raise UserError(f"{what} {p} is not readable (permission denied)")
    if p.stat().st_size == 0:
        raise UserError(f"{what} {p} is empty (expected {expected})")
    return p


def require_dir(path: str | os.PathLike[str], what: str, expected: str = "a directory") -> Path:
    """``path`` as a :class:`Path` if it is a readable directory, else :class:`UserError`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} does not exist (expected {expected})")
    if not p.is_dir():
        raise UserError(f"{what} {p} is a file, not a directory (expected {expected})")
    if not os.access(p, os.R_OK | os.X_OK):
        raise UserError(f"{what} {p} is not readable (permission denied)")
    return p


def require_writable_output(path: str | os.PathLike[str], what: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a :class:`Path` if a file can be written there (its directory exists or can be created
    and is writable; the path itself is not a directory; its suffix is one of ``suffixes`` if given),
    else :class:`UserError`. Checked before the work, so a long job does not fail at its end."""
    p = Path(path)
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(f"{what} {p}: expected a file name ending in {' or '.join(suffixes)}")
    if p.is_dir():
        raise UserError(f"{what} {p} is a directory (expected a file name to write)")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest existing ancestor: the one that must be writable
    if not parent.is_dir():
        raise UserError(f"{what} {p}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{what} {p} cannot be written (permission denied in {parent})")
    return p


def require_range(value: float | int | None, option: str, low: float | None = None, high: float | None = None):
    """``value`` unless it is outside ``[low, high]`` (None: unbounded), then :class:`UserError` naming ``option``."""
    if value is None:
        return value
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise UserError(f"{option} {value}: expected a value {bounds}")
    return value


__all__ = [
    "EXIT_USER_ERROR",
    "UserError",
    "exception_summary",
    "shorten",
    "user_error_message",
    "require_file",
    "require_dir",
    "require_writable_output",
    "require_range",
]
