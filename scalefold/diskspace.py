"""Writes that survive a file system that fills up: the free-space phrase, line files that never tear.

A run on a shared file system meets a full disk (or an exhausted quota) in the middle of a write. What
ScaleFold writes while it trains is of two kinds:

* whole files replaced at once (checkpoints: :func:`scalefold.checkpoint.files.save_atomic`; the
  curves: :func:`atomic_output`): written to a temporary file beside the target, fsync'ed, renamed
  over it -- a failed write leaves the previous file, never a truncated one;
* line files that grow (``metrics.jsonl``, the MLPerf log): :class:`LineAppender` writes whole lines;
  a line the file system takes only in part is cut back off, so the file always ends at a line end
  (every line parses), and the lines that could not be written are kept in memory and written, in
  order, at the next attempt -- once space is back nothing is missing.

Every failure is reported in one line naming the path and the free space (:func:`write_failure`), once
per episode, and the recovery in one more. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from scalefold.errors import exception_summary

#: errno values that mean "the file system (or the user's quota) is full"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: lines a :class:`LineAppender` keeps while its file cannot be written (older ones are dropped, counted)
MAX_PENDING_LINES = 100_000


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (statvfs needs something that exists)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: str | os.PathLike[str]) -> Path:
    """The mount point of the file system ``path`` lies on."""
    path = _existing(Path(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(bytes free to this user, size of the file system)`` where ``path`` lies; ``None`` if unknown."""
    try:
        st = os.statvfs(_existing(Path(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_free(path: str | os.PathLike[str]) -> str:
    """``"0 B free of 8.0 MiB on /mnt/scratch"`` for the file system of ``path``."""
    space = free_bytes(path)
    if space is None:
        return "free space unknown"
    free, total = space
    return f"{format_bytes(free)} free of {format_bytes(total)} on {mount_point(path)}"


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says that the file system (or the quota) is full."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def write_failure(path: str | os.PathLike[str], exc: BaseException) -> str:
    """The reason a write to ``path`` failed, with the free space: ``"no space left on the device (0 B free
    of 8.0 MiB on /mnt/x)"``; other errors by their summary (``"OSError: [Errno 5] Input/output error"``)."""
    if is_full(exc):
        what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left on the device"
        return f"{what} ({describe_free(path)})"
    return f"{exception_summary(exc)} ({describe_free(path)})"


def _say(line: str) -> None:
    """One line on standard error, in one write (ranks share the launcher's pipe)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", errors="replace"))
    except (AttributeError, OSError, ValueError):  # a replaced stderr without a descriptor (e.g. captured)
        print(line, file=sys.stderr, flush=True)


class LineAppender:
    """An append-only file of lines that is never left with a torn line and loses no line to a full disk.

    :meth:`append` queues a line, :meth:`flush` writes the queue (each line one ``write``). A write the file
    system takes in part is cut back to the line's start (``ftruncate``: possible on a full file system, it
    frees space), so a reader always finds whole lines; the lines not written stay queued, in order, for the
    next :meth:`flush`. The first failure of an episode and the recovery are reported in one line each
    (``report``; default: standard error). ``label`` names the file in those lines.
    """

    def __init__(self, path: str | os.PathLike[str], label: str | None = None,
                 report: Callable[[str], None] | None = None, max_pending: int = MAX_PENDING_LINES) -> None:  # fmt: skip
        self.path = Path(path)
        self.label = label or str(self.path)
        self.report = report or _say
        self.max_pending = max_pending
        self._pending: list[bytes] = []
        self._dropped = 0
        self._failing = False
        self.failures = 0  # write attempts that failed (over the file's life)
        self._fd: int | None = None

    @property
    def pending(self) -> int:
        """Lines waiting to be written."""
        return len(self._pending)

    def append(self, line: str) -> None:
        """Queue ``line`` (without its newline)."""
        self._pending.append((line.rstrip("\n") + "\n").encode("utf-8"))
        if len(self._pending) > self.max_pending:
            del self._pending[0]
            self._dropped += 1

    def write(self, line: str) -> bool:
        """:meth:`append` then :meth:`flush`."""
        self.append(line)
        return self.flush()

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def flush(self) -> bool:
        """Write every queued line; ``True`` when none is left. Never raises for a failed write."""
        written = 0
        try:
            fd = self._open()
            for data in self._pending:
                self._write_line(fd, data)
                written += 1
        except OSError as exc:
            del self._pending[:written]
            self.failures += 1
            if not self._failing:
                self._failing = True
                self.report(f"scalefold: cannot write {self.label}: {write_failure(self.path, exc)}; "
                            f"{self.pending} line(s) kept in memory, written when there is space again")  # fmt: skip
            return False
        del self._pending[:written]
        if self._failing:
            self._failing = False
            lost = f"; {self._dropped} older line(s) dropped (more than {self.max_pending} waited)" if self._dropped else ""
            self.report(f"scalefold: {self.label} written again (the lines that waited are in it{lost})")
            self._dropped = 0
        return True

    @staticmethod
    def _write_line(fd: int, data: bytes) -> None:
        """One line, whole or not at all: a short write is cut back off and raises ``ENOSPC``."""
        done = 0
        while done < len(data):
            try:
                n = os.write(fd, data[done:])
            except OSError:
                if done:
                    _cut_back(fd, done)
                raise
            if n == 0:
                _cut_back(fd, done)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += n

    def close(self) -> list[str]:
        """A last :meth:`flush`, then close; returns the lines that could still not be written."""
        self.flush()
        left = [d.decode("utf-8").rstrip("\n") for d in self._pending]
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return left


def _cut_back(fd: int, written: int) -> None:
    """Remove the ``written`` bytes of a torn line from the end of the file (ours, when nothing came after)."""
    with contextlib.suppress(OSError):
        end = os.lseek(fd, 0, os.SEEK_END)
        os.ftruncate(fd, max(end - written, 0))


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; on success it is fsync'ed and renamed over ``path``, on any
    failure removed (``path`` keeps its previous content: never a truncated file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = [
    "FULL_ERRNOS", "LineAppender", "atomic_output", "describe_free", "format_bytes", "free_bytes", "is_full",
    "mount_point", "write_failure",
]  # fmt: skip
