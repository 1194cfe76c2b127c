"""How a training run stops early: a pre-emption signal (checkpoint, exit 0) or too many non-finite
steps in a row (abort).

* :class:`StopRequest` -- SIGTERM / SIGUSR1 (Slurm pre-emption) turned into "checkpoint and stop at the
  end of this step"; every training rank agrees on it in the step's all-reduce, then the loop
  checkpoints and exits 0 (continue with ``--resume``); evaluation ranks serve until training ends;
* :func:`start_multiprocessing_helpers_ignoring_stop_signals`, :func:`ignore_stop_signals` -- the
  loader's helper processes and workers leave the signal to the trainer;
* :class:`NonFiniteGuard` -- a non-finite loss or gradient skips the step on every rank (same verdict
  everywhere); past ``max_consecutive_nonfinite`` in a row the run aborts.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable, Sequence

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


class StopRequest:
    """SIGTERM / SIGUSR1 set a flag; the loop checkpoints at the end of the current step and exits
    (evaluation ranks: they keep serving until training's end-of-training sentinel).

    Use as a context manager: the previous handlers are restored on exit. Re-entrant: a nested
    ``with`` of the same object keeps its handlers (and a signal caught earlier) until the outermost
    ``with`` ends.
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._depth = 0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"`` etc. of the caught signal (``""``: none)."""
        if self.signum is None:
            return ""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def ignore_after_exit(self) -> None:
        """Leave the signals ignored, not the previous handlers back, when the outermost ``with`` ends: the run
        failed (a peer died, or this rank's own error) and the launcher ends the other ranks at once (torchrun
        SIGTERMs every survivor as soon as one worker died); between this ``with``'s exit and the fault's
        handling a default handler would end this rank silently, without the line that names the rank at
        fault."""
        for sig in self._previous:
            self._previous[sig] = signal.SIG_IGN

    def __enter__(self) -> StopRequest:
        self._depth += 1
        if self._depth > 1:
            return self
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def start_multiprocessing_helpers_ignoring_stop_signals() -> None:
    """Start multiprocessing's forkserver and resource tracker now, with SIGTERM / SIGUSR1 ignored.

    Both are started by ``exec`` and an ignored signal stays ignored across ``exec``, so a pre-emption
    signal sent to every process of the task (Slurm) no longer kills them (which made the loader see
    its workers as dead and restart them). The forkserver's children, the loader workers, inherit it
    too (plus :func:`ignore_stop_signals`). Helpers that are already running stay as they are. Call it
    from the main thread before :class:`StopRequest` installs its handlers.

    The forkserver imports what a loader worker runs (:data:`WORKER_PRELOAD`: torch, numpy, h5py and the
    feature pipeline) once, before ``run_start``: every worker it forks starts with them imported, so the
    first batch after ``run_start`` no longer waits for each worker's imports (seconds each; the time
    account's first data wait)."""
    import multiprocessing

    previous = {}
    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave everything as it is
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        return
    try:
        if "forkserver" in multiprocessing.get_all_start_methods():
            from multiprocessing import forkserver

            forkserver.set_forkserver_preload(["__main__", *WORKER_PRELOAD])  # no effect once it is running
            forkserver.ensure_running()  # starts the resource tracker first
        else:
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
    except Exception as exc:  # noqa: BLE001 -- started later by the loader, as before
        warnings.warn(f"could not start the multiprocessing helpers early: {exc}", stacklevel=2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: modules the forkserver imports for the loader workers it forks (an import that fails there is skipped)
WORKER_PRELOAD = ("scalefold.data.loader", "scalefold.data.dataset", "scalefold.train.stopping")


def ignore_stop_signals(worker_id: int = 0) -> None:
    """``worker_init`` of the data-loader workers: SIGTERM / SIGUSR1 are the parent's business.

    Slurm signals every process of a job step (pre-emption: ``scancel --signal``, ``--signal``), loader
    workers included; a worker killed by it would be reported as a failed sample. The training process
    handles the signal (:class:`StopRequest`) and closes its loader when it stops."""
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass


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


__all__ = [
    "NonFiniteGuard", "STOP_SIGNALS", "StopRequest", "TrainingAborted", "ignore_stop_signals",
    "start_multiprocessing_helpers_ignoring_stop_signals",
]  # fmt: skip
