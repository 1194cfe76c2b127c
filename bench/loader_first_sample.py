"""How long a loader takes from its start to its first sample (one worker that imports the feature pipeline, as
the training loader's do), with the forkserver preloading the workers' modules or not (issue 41, item 1).

Usage: ``python bench/loader_first_sample.py preload|plain SECONDS`` (SECONDS: the init before the loader starts,
during which the forkserver imports its preload). Results: bench/RESULTS.md, "Time account"."""
import sys
import time


def sample(index, seed):
    import scalefold.data.dataset  # noqa: F401 -- what StoreSample needs

    return index


if __name__ == "__main__":
    import scalefold.train.stopping as stopping
    from scalefold.data.loader import PriorityQueueLoader

    if sys.argv[1] != "preload":
        stopping.WORKER_PRELOAD = ()
    stopping.start_multiprocessing_helpers_ignoring_stop_signals()
    time.sleep(float(sys.argv[2]))  # the run's init: the forkserver's preload runs meanwhile
    t = time.perf_counter()
    with PriorityQueueLoader(sample, [(0, 0)], num_workers=1, worker_init=stopping.ignore_stop_signals) as loader:
        for _ in loader:
            break
    print(sys.argv[1], f"first sample after {time.perf_counter() - t:.2f} s")
