"""A whole-step graph replay that does not finish within ``--stall-timeout`` is named in one line -- rank,
recycling count, step -- as a stalled rank is (scalefold.compilation.replay_watch): a replay holding NCCL
collectives hangs rather than raises when a peer is gone. A planted stall on the CPU: an emulated replay that
blocks until the watch has spoken."""

from __future__ import annotations

import threading

import pytest

from scalefold.compilation.emulated_capture import EmulatedGraphBackend
from scalefold.compilation.replay_watch import ReplayWatch
from scalefold.compilation.whole_step_graphs import WholeStepGraphs
from scalefold.config.training import TrainConfig
from scalefold.train.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_thread")


class StallingBackend(EmulatedGraphBackend):
    """The emulated capture whose replays, once ``stalled`` is set, block until ``released`` (a peer gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled, self.released = False, threading.Event()

    def capture(self, fn, static_args):
        replay = super().capture(fn, static_args)

        def stalling():
            if self.stalled:
                assert self.released.wait(60), "the watch never spoke"
            return replay()

        return stalling


def test_a_stalled_replay_is_named_in_one_line_and_a_finished_one_is_not():
    lines, released = [], threading.Event()
    watch = ReplayWatch(0.2, rank=3, on_stall=lambda line: (lines.append(line), released.set()), poll_s=0.01)
    watch.at(17)
    with watch.replaying(2):
        assert released.wait(60)
    assert len(lines) == 1 and watch.stalls == 1
    assert lines[0].startswith("scalefold train: rank 3 (host ") and lines[0].endswith("rank 3 stops (exit status 4)")
    assert "the whole-step graph replay of recycling count 2 at step 17 has not finished after" in lines[0]
    quiet = ReplayWatch(30.0, on_stall=lines.append, poll_s=0.01)
    with quiet.replaying(0):
        pass
    assert quiet._armed is None and len(lines) == 1
    off = ReplayWatch(0.0)  # --stall-timeout 0: no watch, no thread
    with off.replaying(1):
        pass
    assert off._thread is None


def test_whole_step_graphs_watch_each_replay():
    step = TrainingStep.build(TrainConfig.from_preset("tiny", env={}))
    backend = StallingBackend()
    graphs = WholeStepGraphs(step, backend=backend, warn=pytest.fail)
    assert graphs.warm_up(step.batch, counts=[0]) == [0]
    lines = []
    graphs.watch = ReplayWatch(0.2, rank=0, on_stall=lambda line: (lines.append(line), backend.released.set()),
                               poll_s=0.01)  # fmt: skip
    graphs.watch.at(5)
    step.opt._n_averaged_host = 1  # past SWA's first update: the step replays
    backend.stalled = True
    assert graphs(step.sliced(0), 0) is not None and graphs.stats.graphed == 1
    assert len(lines) == 1 and "replay of recycling count 0 at step 5 has not finished" in lines[0], lines
