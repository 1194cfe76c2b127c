"""A host-side timer around each whole-step graph replay: a replay that does not finish is named in one line.

A CUDA graph holding NCCL collectives does not raise when a peer is gone or stalled: its kernels wait for
the peer forever, the host's next read of the step's outcome blocks, and the heartbeat
(:mod:`scalefold.distributed.heartbeat`) sees a rank whose main thread made no progress, with no word of
where. :class:`ReplayWatch` arms a timer when a replay starts and disarms it when the replay's work is done
(on a GPU: an event recorded after the replay has completed, polled by the watch's thread; on a CPU, where
the emulated replay runs on the calling thread, when it returns). A replay still running after
``--stall-timeout`` seconds is a fault, said once in the heartbeat's words::

    scalefold train: rank 1 (host node17, pid 4809): the whole-step graph replay of recycling count 2 at
    step 17 has not finished after 300 s (a collective inside the graph waits for a dead or stalled peer?);
    rank 1 stops (exit status 4)

and the rank ends as the heartbeat ends a blocked rank (``on_fatal`` hooks, then exit status 4): a replay
cannot be interrupted.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from scalefold.distributed.heartbeat import EXIT_RANK_FAILED


class ReplayWatch:
    """``with watch.replaying(n): graph.replay()`` -- a replay not finished after ``timeout_s`` is reported by
    ``on_stall(line)`` (default: the line on stderr, the ``on_fatal`` hooks, exit status 4); ``timeout_s``
    <= 0: no watch; ``cuda``: the replays are a GPU's (asynchronous: watched until an event recorded after
    them completes). :meth:`at` sets the training step the line names."""

    def __init__(self, timeout_s: float, rank: int = 0, cuda: bool = False, on_stall: Callable[[str], None] | None = None,
                 on_fatal: list[Callable[[], None]] | None = None, poll_s: float | None = None) -> None:  # fmt: skip
        self.timeout_s, self.rank, self.cuda = timeout_s, rank, cuda
        self.on_stall = on_stall or self._stop
        self.on_fatal = on_fatal if on_fatal is not None else []
        self.poll_s = poll_s if poll_s is not None else min(max(timeout_s / 20.0, 0.05), 2.0)
        self.step = 0
        self.stalls = 0
        self._armed: list[Any] | None = None  # [recycling count, step, start time, event or None]
        self._thread: threading.Thread | None = None

    def at(self, step: int) -> None:
        self.step = step

    @contextmanager
    def replaying(self, n: int) -> Iterator[None]:
        if self.timeout_s <= 0:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scalefold-replay-watch", daemon=True)
            self._thread.start()
        armed = [n, self.step, time.monotonic(), None]
        self._armed = armed
        try:
            yield
        finally:
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
                armed[3] = event  # disarmed by the watch's thread once the replay's kernels are done
            elif self._armed is armed:
                self._armed = None

    def line(self, n: int, step: int, waited_s: float) -> str:
        who = f"rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()})"
        return (f"scalefold train: {who}: the whole-step graph replay of recycling count {n} at step {step} has not "
                f"finished after {waited_s:.3g} s (a collective inside the graph waits for a dead or stalled peer?); "
                f"rank {self.rank} stops (exit status {EXIT_RANK_FAILED})")  # fmt: skip

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            armed = self._armed
            if armed is None:
                continue
            event = armed[3]
            if event is not None and event.query():
                if self._armed is armed:
                    self._armed = None
                continue
            waited = time.monotonic() - armed[2]
            if waited > self.timeout_s:
                self._armed = None
                self.stalls += 1
                self.on_stall(self.line(armed[0], armed[1], waited))

    def _stop(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        for hook in self.on_fatal:
            try:
                hook()
            except Exception:  # noqa: BLE001 -- the rank ends either way
                pass
        os._exit(EXIT_RANK_FAILED)


__all__ = ["ReplayWatch"]
