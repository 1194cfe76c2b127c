"""Training progress as plain lines, for a standard error that is not a terminal.

A Slurm job's log file (``#SBATCH --output``, ``> log 2>&1``) holds every carriage-return update a
progress bar draws: one per step. :func:`scalefold.train.reporting.progress_bar` returns a
:class:`PlainProgress` instead when standard error is not a terminal; it writes one line now and
then (the first step, then at most one line every ``interval_s`` seconds, and the last step)::

    train: step 120/2000 (6 %)  loss 1.234  1.52 s/step  elapsed 3m02s  ETA 47m38s

It offers the part of tqdm's interface the training loop and the evaluation use (``update``,
``set_postfix``, ``set_description``, ``write``, ``close``); ``write`` goes to standard output as
``tqdm.write`` does. The MLPerf log and ``metrics.jsonl`` are written elsewhere and unaffected.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: seconds between two progress lines (besides the first and the last step's)
DEFAULT_INTERVAL_S = 30.0


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_duration(seconds: float) -> str:
    """``47m38s``, ``2h05m``, ``9s``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class PlainProgress:
    """Rate-limited progress lines on ``stream`` (standard error by default)."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "train",
        stream: TextIO | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s, self.clock = interval_s, clock
        self.postfix: dict[str, Any] = {}
        self._first: tuple[int, float] | None = None  # (step, time) of the first update: the rate's origin
        self._last: tuple[int, float] | None = None  # (step, time) of the last line written
        self._due: float | None = None  # time of the update whose line is still to be written
        self._closed = False

    def update(self, n: int = 1) -> None:
        """``n`` more steps done; a line is due on the first, after ``interval_s``, and on the last. It is
        written by the ``set_postfix`` that follows (the loop reports the step's loss right after), or
        by the next ``update``/``close``."""
        self._flush()
        now = self.clock()
        start = self.n
        self.n += n
        if self._first is None:  # the rate is measured from the first step's end (after compile, data)
            self._first, self._last = (self.n, now), (start, now)
            self._due = now
        elif now - self._last[1] >= self.interval_s or self.n >= self.total:
            self._due = now

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values
        self._flush()

    def set_description(self, desc: str, refresh: bool = True) -> None:
        """The bar's label (the evaluation sets it while it runs): not printed, lines name the run phase."""

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        if not self._closed and self._last is not None and self._last[0] != self.n and self._due is None:
            self._due = self.clock()
        self._flush()
        self._closed = True

    def _flush(self) -> None:
        if self._due is not None:
            self._line(self._due)
            self._due = None

    def _line(self, now: float) -> None:
        parts = [f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f} %)"]
        if "loss" in self.postfix:
            parts.append(f"loss {self.postfix['loss']}")
        last_step, last_time = self._last
        if self.n > last_step and now > last_time:
            parts.append(f"{(now - last_time) / (self.n - last_step):.2f} s/step")
        first_step, first_time = self._first
        if self.n > first_step:
            per_step = (now - first_time) / (self.n - first_step)
            parts.append(f"elapsed {format_duration(now - first_time)}")
            parts.append(f"ETA {format_duration(per_step * max(self.total - self.n, 0))}")
        self.stream.write("  ".join(parts) + "\n")  # the whole line in one write (ranks may share the file)
        self.stream.flush()
        self._last = (self.n, now)


__all__ = ["DEFAULT_INTERVAL_S", "PlainProgress", "format_duration", "is_terminal"]
