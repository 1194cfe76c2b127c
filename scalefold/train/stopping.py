"""How a training run stops early: too many non-finite steps in a row (abort), or a pre-emption signal.

A pre-emption signal (SIGTERM / SIGUSR1, :class:`~scalefold.train.steps.StopRequest`) is agreed on by
every training rank in the step's all-reduce; the loop then checkpoints and exits 0 (continue with
``--resume``). A non-finite loss or gradient skips the step on every rank (same verdict everywhere);
:class:`NonFiniteGuard` counts them and aborts the run past ``max_consecutive_nonfinite`` in a row.
"""

from __future__ import annotations

from collections.abc import Callable


class TrainingAborted(RuntimeError):
    """The run stopped without reaching its end (``run_stop status=aborted`` was logged)."""


class NonFiniteGuard:
    """Consecutive skipped (non-finite) steps; :meth:`check` raises :class:`TrainingAborted` past the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0

    def ok(self) -> None:
        self.consecutive = 0

    def skipped(self, step: int, total: int, say: Callable[[str], None] | None) -> None:
        """Step ``step`` was skipped (``total`` so far); ``say`` prints the line (main rank only)."""
        self.consecutive += 1
        if say is not None:
            say(f"step {step}: non-finite loss/gradient, step skipped ({self.consecutive} in a row, {total} in total)")

    def check(self, step: int, before_abort: Callable[[], None]) -> None:
        if self.consecutive > self.limit:
            before_abort()
            raise TrainingAborted(f"{self.consecutive} consecutive non-finite steps (limit {self.limit}) at step {step}")


__all__ = ["NonFiniteGuard", "TrainingAborted"]
