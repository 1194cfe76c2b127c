"""Time to train (MLPerf: ``run_start`` to ``run_stop``), carried across ``--resume``."""

from __future__ import annotations

import time
from typing import Any


class RunClock:
    """MLPerf's time to train (``run_start`` to ``run_stop``) summed over the segments of a run that
    was interrupted and resumed: every checkpoint records the time so far (``state``), a resumed run
    starts from the one it loads (``carry``). Work after the newest checkpoint of an interrupted
    segment is redone by the next one and counted there (wall time of the redone steps is not added
    twice)."""

    def __init__(self) -> None:
        self.before_s, self.segments_before, self.resumed_step = 0.0, 0, 0
        self._t0: float | None = None
        self._t1: float | None = None  # run_stop (None: still running)

    def carry(self, ckpt: dict[str, Any], step: int) -> None:
        """Continue the clock of the checkpoint ``ckpt`` (of step ``step``) a resumed run loaded."""
        state = ckpt.get("time_to_train")
        if isinstance(state, dict):
            self.before_s = float(state.get("seconds", 0.0))
            self.segments_before = int(state.get("segments", 1))
            self.resumed_step = step

    def start(self) -> None:
        self._t0 = time.time()

    def stop(self, at: float | None = None) -> None:
        """``run_stop`` was logged (now, or at wall time ``at`` by another process); the first call counts."""
        if self._t0 is not None and self._t1 is None:
            self._t1 = time.time() if at is None else at

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def segment_s(self) -> float:
        if self._t0 is None:
            return 0.0
        return (self._t1 if self._t1 is not None else time.time()) - self._t0

    def total_s(self) -> float:
        return self.before_s + self.segment_s()

    def state(self) -> dict[str, Any]:
        return {"seconds": self.total_s(), "segments": self.segments_before + 1}


__all__ = ["RunClock"]
