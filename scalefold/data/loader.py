"""Training data loaders: ScaleFold's non-blocking priority-queue loader and the in-order loader.

Both run a pool of worker processes that turn ``(index, seed)`` pairs into batches with a
user-supplied, picklable ``sample_fn(index, seed) -> dict``; they differ in how work is handed
out and how finished batches are delivered:

* :class:`PriorityQueueLoader` (ScaleFold, "non-blocking data pipeline"): any idle worker takes
  the next sample; finished batches go into a bounded priority queue keyed by the sample's
  position in the sampler's sequence; the training loop takes the lowest-position batch that is
  *ready*, so one slow sample (deep MSA, long chain) never stalls a step. Order is best effort;
  ``deterministic=True`` delivers strictly in position order instead (still with idle-worker
  dispatch).
* :class:`InOrderLoader` (the reference ``InitialTrainingDataloaderPT``, i.e. a PyTorch
  ``DataLoader``): position ``p`` goes to worker ``p % num_workers`` with ``prefetch_factor``
  samples outstanding per worker, and batches are delivered strictly in order — a slow sample
  blocks everything behind it.

Robustness (both loaders): a worker that dies (segfault, OOM kill, ``os._exit``) or exceeds
``sample_timeout`` is replaced and its samples are retried; a sample that fails
``max_attempts`` times (exception or crash) is skipped and recorded in :attr:`skipped` with the
reason, and logged. Without a ``replace`` hook the skipped position is simply missing from the
output; with one (the training loop's choice) the position gets a replacement ``(index, seed)``
drawn by the hook, so the loader always delivers exactly ``len(sampler)`` batches -- every rank of
a distributed run then takes the same number of steps -- and only a position whose
``max_replacements`` replacements all fail too stops the loader with an error. Workers open
their resources lazily inside ``sample_fn`` (e.g. a :class:`~scalefold.data.store.Store`, which
re-opens its HDF5 file per process), so the loaders are safe under ``spawn``, ``forkserver`` and
``fork``. ``close()`` (or leaving the ``with`` block, or exhausting the iterator) stops every
worker; no process outlives the loader.

With Dynamic Axial Parallelism one rank per DAP group loads: :func:`group_batches` iterates its
loader and broadcasts each batch to the group's other ranks, which run no loader; an explicit
end-of-data (or loader-failure) header tells the receivers when to stop, so they never wait for a
batch that will not come. (The per-batch ``broadcast`` hook of the loaders is applied on the
loading rank; identity by default.)

:class:`Sampler` produces the ``(index, seed)`` pairs with the reference's
``InitialTrainingSampler`` semantics.
"""

from __future__ import annotations

import collections
import heapq
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SampleFn = Callable[[int, int], Any]
BroadcastFn = Callable[[Any], Any]
# replace(position, replacement number (1, 2, ...), indices that failed so far) -> (index, seed)
ReplaceFn = Callable[[int, int, frozenset], tuple[int, int]]

# The reference draws per-sample seeds uniformly in [0, 2**63 - 1).
SEED_HIGH = 2**63 - 1
DEFAULT_PREFETCH_FACTOR = 4
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_MAX_REPLACEMENTS = 8
WORKER_JOIN_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.05


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------


class Sampler:
    """``(index, seed)`` pairs drawn from per-chain weights (reference ``InitialTrainingSampler``).

    ``num_samples`` indices are drawn multinomially *with replacement* from ``weights`` with a
    ``torch.Generator`` seeded by ``seed``; the per-sample seeds come from a second generator
    with the same seed (``torch.randint(0, 2**63 - 1)``). With several data-parallel ranks each
    rank takes every ``world_size``-th pair starting at ``rank``; ``start`` skips pairs this rank
    already consumed (resuming from a checkpoint).
    """

    def __init__(
        self,
        weights: Sequence[float],
        num_samples: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
    ) -> None:
        import torch

        if num_samples % world_size:
            raise ValueError(f"num_samples={num_samples} must be divisible by world_size={world_size}")
        weights_t = torch.as_tensor(weights, dtype=torch.float64)
        index_gen = torch.Generator().manual_seed(seed)
        indices = torch.multinomial(weights_t, num_samples=num_samples, replacement=True, generator=index_gen)
        seed_gen = torch.Generator().manual_seed(seed)
        seeds = torch.randint(low=0, high=SEED_HIGH, size=[num_samples], generator=seed_gen)
        pairs = list(zip(indices.tolist(), seeds.tolist()))[rank::world_size]
        if not 0 <= start <= len(pairs):
            raise ValueError(f"start={start} outside [0, {len(pairs)}]")
        self.pairs: list[tuple[int, int]] = pairs[start:]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


# ---------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------

# Messages worker -> parent: ("ready", None, pid) | ("start", position, None) | ("ok", position, batch)
#                            | ("error", position, reason)
# Messages parent -> worker: (position, index, seed) | None (stop)
# "start" is sent when the worker begins a sample: ``sample_timeout`` counts from it, so neither the
# worker's start-up (imports, forkserver under load) nor time queued behind another sample counts.


def _worker_main(worker_id: int, conn, sample_fn: SampleFn, worker_init: Callable[[int], None] | None) -> None:
    """Loop of one worker process: receive a task, build the sample, send it back. A parent that went away
    (killed: a dead rank) ends the worker quietly -- no traceback of a broken pipe in the run's output."""
    try:
        _worker_loop(worker_id, conn, sample_fn, worker_init)
    except (BrokenPipeError, ConnectionResetError):
        return  # parent went away


def _worker_loop(worker_id: int, conn, sample_fn: SampleFn, worker_init: Callable[[int], None] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    if worker_init is not None:
        worker_init(worker_id)
    conn.send(("ready", None, os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if task is None:
            return
        position, index, seed = task
        conn.send(("start", position, None))
        try:
            batch = sample_fn(index, seed)
        except Exception as exc:  # noqa: BLE001 - report any failure of one sample
            reason = f"{type(exc).__name__}: {exc}"
            detail = traceback.format_exc(limit=-3)
            conn.send(("error", position, f"{reason}\n{detail}"))
            continue
        conn.send(("ok", position, batch))


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker stopped responding"
    if exitcode < 0:
        try:
            return f"worker killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker killed by signal {-exitcode}"
    return f"worker exited with code {exitcode}"


def default_mp_context() -> str:
    """``forkserver`` where available (fork-safety without spawn's start-up cost), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# ---------------------------------------------------------------------------------------------
# The engine shared by both loaders
# ---------------------------------------------------------------------------------------------


@dataclass
class SkippedSample:
    """A sample given up after ``attempts`` failures (``replaced_by``: the ``(index, seed)`` built
    for its position instead, when the loader has a ``replace`` hook)."""

    position: int
    index: int
    seed: int
    attempts: int
    reason: str
    replaced_by: tuple[int, int] | None = None


@dataclass
class _Task:
    position: int
    index: int
    seed: int
    attempts: int = 0


class _Worker:
    def __init__(self, ctx, worker_id: int, sample_fn: SampleFn, worker_init) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.id = worker_id
        self.conn = parent_conn
        self.process = ctx.Process(
            target=_worker_main,
            args=(worker_id, child_conn, sample_fn, worker_init),
            name=f"scalefold-loader-{worker_id}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.inflight: collections.deque[_Task] = collections.deque()
        self.started_at: float | None = None  # when the worker reported starting its front task
        self.ready = False

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError, BrokenPipeError):
            pass

    def reap(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class _Engine:
    """Worker pool + dispatch + bounded ready-queue; runs its bookkeeping in a background thread."""

    def __init__(
        self,
        sample_fn: SampleFn,
        pairs: Sequence[tuple[int, int]],
        num_workers: int,
        capacity: int,
        ordered: bool,
        round_robin: bool,
        per_worker_limit: int,
        max_attempts: int,
        sample_timeout: float | None,
        mp_context: str | None,
        worker_init: Callable[[int], None] | None,
        replace: ReplaceFn | None = None,
        max_replacements: int = DEFAULT_MAX_REPLACEMENTS,
    ) -> None:
        self.sample_fn = sample_fn
        self.pairs = list(pairs)
        self.num_workers = num_workers
        self.capacity = capacity
        self.ordered = ordered
        self.round_robin = round_robin
        self.per_worker_limit = per_worker_limit
        self.max_attempts = max_attempts
        self.sample_timeout = sample_timeout
        self.worker_init = worker_init
        self.ctx = multiprocessing.get_context(mp_context or default_mp_context())

        self.cond = threading.Condition()
        self.ready: list[tuple[int, Any]] = []  # heap of (position, batch)
        self.pending: collections.deque[_Task] = collections.deque(
            _Task(p, int(i), int(s)) for p, (i, s) in enumerate(self.pairs)
        )
        self.retries: list[tuple[int, _Task]] = []  # heap: retried samples go first
        self.finished: set[int] = set()  # delivered or skipped
        self.skipped: list[SkippedSample] = []
        self.replace = replace
        self.max_replacements = max_replacements
        self.replacements: dict[int, int] = {}  # position -> replacements drawn for it
        self.failed_indices: set[int] = set()
        self.next_position = 0  # ordered mode: the position to deliver next
        self.restarts = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.workers: list[_Worker] = []
        self.thread: threading.Thread | None = None

    # -- lifecycle
    def start(self, wait_ready: bool) -> None:
        self.workers = [_Worker(self.ctx, w, self.sample_fn, self.worker_init) for w in range(self.num_workers)]
        self.thread = threading.Thread(target=self._run, name="scalefold-loader", daemon=True)
        self.thread.start()
        if wait_ready:
            with self.cond:
                self.cond.wait_for(lambda: self.error is not None or all(w.ready for w in self.workers))

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        for w in self.workers:
            w.stop()
        deadline = time.monotonic() + WORKER_JOIN_TIMEOUT_S
        for w in self.workers:
            w.reap(max(deadline - time.monotonic(), 0.01))
        self.workers = []
        self.ready = []

    # -- consumer side
    def get(self) -> tuple[int, Any] | None:
        """The next batch as ``(position, batch)``, or None when every sample is accounted for."""
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError("data loader failed") from self.error
                if self.ordered:
                    while self.next_position in self.finished and not (
                        self.ready and self.ready[0][0] == self.next_position
                    ):
                        self.next_position += 1
                    if self.ready and self.ready[0][0] == self.next_position:
                        item = heapq.heappop(self.ready)
                        self.next_position += 1
                        self.cond.notify_all()
                        return item
                elif self.ready:
                    item = heapq.heappop(self.ready)
                    self.cond.notify_all()
                    return item
                if len(self.finished) == len(self.pairs) and not self.ready:
                    return None
                if self.stopping:
                    return None
                self.cond.wait()

    # -- background thread
    def _inflight(self) -> int:
        return sum(len(w.inflight) for w in self.workers)

    def _next_task(self, worker: _Worker) -> _Task | None:
        """A task this worker may take now, respecting the bounded queue and the dispatch policy."""
        if len(self.ready) + self._inflight() >= self.capacity:
            return None
        if len(worker.inflight) >= self.per_worker_limit:
            return None
        if self.retries:
            return heapq.heappop(self.retries)[1]
        if not self.pending:
            return None
        if self.round_robin and self.pending[0].position % self.num_workers != worker.id:
            return None
        return self.pending.popleft()

    def _dispatch(self) -> None:
        progress = True
        while progress:
            progress = False
            for w in self.workers:
                task = self._next_task(w)
                if task is None:
                    continue
                w.inflight.append(task)
                try:
                    w.conn.send((task.position, task.index, task.seed))
                except (OSError, BrokenPipeError):
                    pass  # the worker is dead: its death is handled with its in-flight tasks
                progress = True

    def _fail(self, task: _Task, reason: str) -> None:
        task.attempts += 1
        if task.attempts < self.max_attempts:
            logger.warning(
                "sample at position %d (index %d) failed (attempt %d/%d), retrying: %s",
                task.position, task.index, task.attempts, self.max_attempts, reason.splitlines()[0],
            )  # fmt: skip
            heapq.heappush(self.retries, (task.position, task))
            return
        logger.error(
            "skipping sample at position %d (index %d) after %d attempts: %s",
            task.position, task.index, task.attempts, reason,
        )  # fmt: skip
        skip = SkippedSample(task.position, task.index, task.seed, task.attempts, reason)
        self.skipped.append(skip)
        self.failed_indices.add(task.index)
        if self.replace is None:
            self.finished.add(task.position)  # the position is missing from the output
            return
        k = self.replacements.get(task.position, 0) + 1
        if k > self.max_replacements:  # raised in the bookkeeping thread: the consumer gets the error
            raise RuntimeError(
                f"sample at position {task.position}: {self.max_replacements} replacement samples failed as well "
                f"(last: index {task.index}: {reason.splitlines()[0]})"
            )
        self.replacements[task.position] = k
        index, seed = self.replace(task.position, k, frozenset(self.failed_indices))
        skip.replaced_by = (int(index), int(seed))
        logger.warning(
            "sample at position %d: replacement %d/%d is index %d (seed %d)",
            task.position, k, self.max_replacements, index, seed,
        )  # fmt: skip
        heapq.heappush(self.retries, (task.position, _Task(task.position, int(index), int(seed))))

    def _handle_message(self, w: _Worker, message: tuple) -> None:
        kind, position, payload = message
        if kind == "ready":
            w.ready = True
            return
        if not w.inflight or w.inflight[0].position != position:
            return  # stale (already re-dispatched after a timeout): ignore
        if kind == "start":
            w.started_at = time.monotonic()
            return
        task = w.inflight.popleft()
        w.started_at = None  # the next task's clock starts with its own "start" message
        if position in self.finished:
            return
        if kind == "ok":
            self.finished.add(position)
            heapq.heappush(self.ready, (position, payload))
        else:
            self._fail(task, payload)

    def _drain(self, w: _Worker) -> None:
        """Handle every message the worker has sent so far."""
        try:
            while w.conn.poll():
                self._handle_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass  # died mid-message: handled through its sentinel

    def _timed_out(self, w: _Worker) -> bool:
        """Whether the worker's current sample has run longer than ``sample_timeout`` since the worker
        reported starting it. Messages that arrived meanwhile are read first, so a result already in
        the pipe (a bookkeeping thread starved by a loaded machine) is never mistaken for a hang."""
        if w.started_at is None or time.monotonic() - w.started_at <= self.sample_timeout:
            return False
        self._drain(w)
        return w.started_at is not None and time.monotonic() - w.started_at > self.sample_timeout

    def _replace(self, w: _Worker, reason: str) -> None:
        """Replace a dead (or hung) worker; its current sample counts as failed, queued ones are re-sent."""
        tasks = list(w.inflight)
        w.inflight.clear()
        if w.process.is_alive():
            w.process.kill()
        w.reap(WORKER_JOIN_TIMEOUT_S)
        self.restarts += 1
        logger.warning("data loader worker %d (pid %s): %s; restarting it", w.id, w.process.pid, reason)
        fresh = _Worker(self.ctx, w.id, self.sample_fn, self.worker_init)
        self.workers[w.id] = fresh
        if tasks:
            self._fail(tasks[0], reason)
            for t in tasks[1:]:
                heapq.heappush(self.retries, (t.position, t))

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if self.stopping or len(self.finished) == len(self.pairs):
                        self.cond.notify_all()
                        return
                    self._dispatch()
                    conns = {w.conn: w for w in self.workers}
                    sentinels = {w.process.sentinel: w for w in self.workers}
                ready = multiprocessing.connection.wait(list(conns) + list(sentinels), timeout=POLL_INTERVAL_S)
                with self.cond:
                    for obj in ready:
                        w = conns.get(obj)
                        if w is not None and self.workers[w.id] is w:
                            self._drain(w)
                    for obj in ready:
                        w = sentinels.get(obj)
                        if w is not None and self.workers[w.id] is w and not w.process.is_alive():
                            self._replace(w, _exit_reason(w.process.exitcode))
                    if self.sample_timeout is not None:
                        for w in list(self.workers):
                            if self._timed_out(w):
                                self._replace(w, f"sample timed out after {self.sample_timeout:g} s")
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - surface any bookkeeping error to the consumer
            with self.cond:
                self.error = exc
                self.cond.notify_all()


# ---------------------------------------------------------------------------------------------
# Public loaders
# ---------------------------------------------------------------------------------------------


class _LoaderBase:
    _ordered: bool = True
    _round_robin: bool = False

    def __init__(
        self,
        sample_fn: SampleFn,
        sampler: Iterable[tuple[int, int]],
        num_workers: int = 2,
        prefetch_factor: int = DEFAULT_PREFETCH_FACTOR,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        sample_timeout: float | None = None,
        mp_context: str | None = None,
        broadcast: BroadcastFn | None = None,
        worker_init: Callable[[int], None] | None = None,
        replace: ReplaceFn | None = None,
        max_replacements: int = DEFAULT_MAX_REPLACEMENTS,
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if prefetch_factor < 1:
            raise ValueError("prefetch_factor must be >= 1")
        self.sample_fn = sample_fn
        self.pairs = [(int(i), int(s)) for i, s in sampler]
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.max_attempts = max_attempts
        self.sample_timeout = sample_timeout
        self.mp_context = mp_context
        self.broadcast = broadcast
        self.worker_init = worker_init
        self.replace = replace
        self.max_replacements = max_replacements
        self._engine: _Engine | None = None
        self._skipped: list[SkippedSample] = []
        self.restarts = 0

    @property
    def skipped(self) -> list[SkippedSample]:
        """Samples given up so far, in the order they were given up (live while iterating)."""
        engine = self._engine
        if engine is None:
            return list(self._skipped)
        with engine.cond:
            return list(engine.skipped)

    @property
    def queue_depth(self) -> int:
        """Bound on samples being built or waiting to be consumed (``num_workers * prefetch_factor``)."""
        return self.num_workers * self.prefetch_factor

    def _per_worker_limit(self) -> int:
        return self.prefetch_factor

    def __len__(self) -> int:
        return len(self.pairs)

    def start(self, wait_ready: bool = True) -> None:
        """Start the workers (done by iteration too); ``wait_ready`` blocks until they are up."""
        if self._engine is not None:
            return
        self._engine = _Engine(
            self.sample_fn,
            self.pairs,
            self.num_workers,
            capacity=self.queue_depth,
            ordered=self._ordered,
            round_robin=self._round_robin,
            per_worker_limit=self._per_worker_limit(),
            max_attempts=self.max_attempts,
            sample_timeout=self.sample_timeout,
            mp_context=self.mp_context,
            worker_init=self.worker_init,
            replace=self.replace,
            max_replacements=self.max_replacements,
        )
        self._engine.start(wait_ready)

    def close(self) -> None:
        """Stop and reap every worker process (idempotent)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
            self._skipped = list(engine.skipped)
            self.restarts = engine.restarts

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._engine.workers] if self._engine is not None else []

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """Yields ``(position, batch)``: ``position`` is the pair's place in the sampler sequence."""
        self.start(wait_ready=False)
        engine = self._engine
        try:
            while True:
                item = engine.get()
                if item is None:
                    break
                position, batch = item
                if self.broadcast is not None:
                    batch = self.broadcast(batch)
                yield position, batch
        finally:
            self._skipped = list(engine.skipped)
            self.restarts = engine.restarts
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; prefer ``with`` or ``close()``
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class PriorityQueueLoader(_LoaderBase):
    """ScaleFold's non-blocking loader: the lowest-position *ready* batch is delivered first.

    Args:
        sample_fn: picklable ``(index, seed) -> batch``; runs in the worker processes.
        sampler: iterable of ``(index, seed)`` pairs (e.g. :class:`Sampler`).
        num_workers: worker processes.
        prefetch_factor: queue depth per worker: at most ``num_workers * prefetch_factor``
            samples are being built or waiting to be consumed.
        deterministic: deliver strictly in sampler order (reproducible runs), still dispatching
            to whichever worker is idle.
        max_attempts: tries per sample (exceptions and worker crashes) before it is skipped.
        sample_timeout: seconds after which a sample's worker is killed and the sample retried.
        mp_context: ``"forkserver"`` (default where available), ``"spawn"`` or ``"fork"``.
        broadcast: hook applied to each batch before it is yielded (DAP: send to the group).
        worker_init: called with the worker id in each worker process before its first sample.
        replace: ``(position, k, failed_indices) -> (index, seed)``, called (in the loader's own
            thread, never in a worker) for the ``k``-th replacement of a skipped sample's position;
            ``None``: skipped positions are left out.
        max_replacements: replacements tried per position before the loader fails.
    """

    def __init__(
        self, sample_fn: SampleFn, sampler: Iterable[tuple[int, int]], *, deterministic: bool = False, **kwargs
    ) -> None:
        super().__init__(sample_fn, sampler, **kwargs)
        self._ordered = deterministic

    def _per_worker_limit(self) -> int:
        return 1  # an idle worker takes the next sample: nothing queues behind a slow one


class InOrderLoader(_LoaderBase):
    """Reference ``InitialTrainingDataloaderPT`` semantics (a PyTorch ``DataLoader``).

    Position ``p`` is built by worker ``p % num_workers``, each worker has up to
    ``prefetch_factor`` samples outstanding, and batches are delivered strictly in order.
    Same arguments as :class:`PriorityQueueLoader` (without ``deterministic``).
    """

    _ordered = True
    _round_robin = True


#: Loader backends selectable by name (``--loader``): ScaleFold's priority queue (default) and the
#: reference in-order loader. (A DALI backend was measured slower than both and is not offered:
#: ``bench/dali_loader.py`` has it and the numbers.)
LOADERS = ("pq", "inorder")


def make_loader(kind: str, sample_fn: SampleFn, sampler: Iterable[tuple[int, int]], **kwargs):
    """The loader named ``kind`` (one of :data:`LOADERS`) over ``sampler``; ``kwargs`` as for
    :class:`PriorityQueueLoader` (``deterministic`` only applies to ``"pq"``)."""
    if kind == "pq":
        return PriorityQueueLoader(sample_fn, sampler, **kwargs)
    deterministic = kwargs.pop("deterministic", True)
    if not deterministic:
        logger.info("loader %r always delivers in sampler order; deterministic=False has no effect", kind)
    if kind == "inorder":
        return InOrderLoader(sample_fn, sampler, **kwargs)
    raise ValueError(f"unknown loader {kind!r}; choose one of {', '.join(LOADERS)}")


def identity_broadcast(batch: Any) -> Any:
    """The default ``broadcast`` hook: no DAP group, nothing to send."""
    return batch


class DataLoaderFailed(RuntimeError):
    """The loader rank of a DAP group failed; raised on the group's other ranks (:func:`group_batches`)."""


def group_batches(
    loader: Iterable[tuple[int, Any]] | None, src: int, group=None, device=None, with_batch: bool = True
) -> Iterator[tuple[int, Any]]:
    """One loader per DAP group: the same ``(position, batch)`` sequence on every rank of ``group``.

    The group's loader rank (global rank ``src``) passes its loader (any of the loaders here) and
    iterates it; the other ranks pass ``None`` and receive each batch (a dict of tensors) through
    :func:`scalefold.distributed.data.broadcast_batch`, allocated on ``device``. Per batch the
    loader rank first broadcasts a header: the position, or ``None`` (no more data: every rank
    stops), or the loader's error (every other rank raises :class:`DataLoaderFailed` naming it, instead
    of waiting for a batch that never comes); then the tensors. With ``with_batch=False`` only the
    header travels and the other ranks get ``(position, None)``: the caller broadcasts the batch
    itself (the training loop sends the step's slice of it). All ranks of the group must consume the
    same number of batches (the training loop steps in lockstep); leaving early on the loader rank
    closes its loader.
    """
    import torch.distributed as dist

    from scalefold.distributed.data import broadcast_batch

    is_src = dist.get_rank() == src
    if is_src != (loader is not None):
        raise ValueError(f"group_batches: rank {dist.get_rank()} must pass a loader exactly when it is src={src}")
    iterator = iter(loader) if is_src else None
    try:
        while True:
            item = None
            if is_src:
                try:
                    item = next(iterator, None)
                except Exception as exc:  # tell the group before failing: nobody waits for this rank forever
                    message = f"rank {src}: {type(exc).__name__}: {exc}"
                    if exc.__cause__ is not None:
                        message += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
                    dist.broadcast_object_list([("error", message)], src=src, group=group)
                    raise
            header: list[Any] = [None if item is None else int(item[0])]
            dist.broadcast_object_list(header, src=src, group=group)
            if isinstance(header[0], tuple):  # ("error", message) of the loader rank
                raise DataLoaderFailed(f"the data loader of this rank's group failed on {header[0][1]}")
            if header[0] is None:
                return
            if not with_batch:
                yield header[0], (item[1] if is_src else None)
                continue
            yield header[0], broadcast_batch(item[1] if is_src else None, src=src, group=group, device=device)
    finally:
        if is_src:
            for resource in (iterator, loader):  # a generator, then the loader: stop its workers
                if hasattr(resource, "close"):
                    resource.close()


__all__ = [
    "LOADERS",
    "make_loader",
    "Sampler",
    "PriorityQueueLoader",
    "InOrderLoader",
    "SkippedSample",
    "DataLoaderFailed",
    "identity_broadcast",
    "group_batches",
    "default_mp_context",
]
