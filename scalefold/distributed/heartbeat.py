"""Dead and stalled ranks: a heartbeat over a side channel, and the one line that names the rank at fault.

A rank that dies (SIGKILL, an exception, a lost node) breaks its peers' collectives with a transport
error that names no rank (gloo: "Connection reset by peer"); a rank that stalls (SIGSTOP, a hung device,
a stuck file read) leaves its peers waiting in a collective until the process group's timeout (30 min),
naming nobody. :class:`Heartbeat` is the side channel that names them: every rank runs a thread that,
every ``interval_s``, writes its beat to a ``TCPStore`` client of its own (the launcher's rendezvous
store: torchrun's agent, or rank 0's under srun / mpirun), keys under ``scalefold/faults/<attempt>/``:

* ``beat/<rank>``: a counter, the rank's progress (``2 x step`` in a step, ``+ 1`` waiting for the next
  batch), its step and a busy phase (evaluation, checkpoint: long on one rank by design);
* ``info/<rank>``: host, pid, role; ``gone/<rank>``: why a rank left (``done``, ``peer``, ``failed: ...``);
* ``fault``: the first fault found, set once (compare-and-set): every survivor prints the same one.

How a fault is found:

* **dead**: the collective's transport error reaches the main thread; :meth:`Heartbeat.explain` looks for
  the rank at fault (its own report of an exception; its process gone, when on this host; its beat
  quiet for three intervals) for at most ``dead_peer_timeout_s``;
* **stalled**: each rank watches the beat of the next one (ring: ``O(world)`` store traffic); a beat quiet
  for ``stall_timeout_s`` is a fault. A rank whose own progress stops for ``stall_timeout_s`` outside a
  busy phase reads every beat once: a quiet one, or a rank behind the others (its main thread stuck
  while its heartbeat runs), is the fault;
* once ``fault`` is set, every rank's main thread has ``dead_peer_timeout_s`` to end by itself (a broken
  collective raises); a rank still blocked then (waiting for a stopped peer) is ended by its heartbeat
  thread: the line, the Python stacks of every thread to a file in the run directory, the ``on_fatal``
  hooks (the MLPerf log's ``run_stop aborted``), ``os._exit(EXIT_RANK_FAILED)``.

The line, on every survivor::

    scalefold train: rank 1 (host node17, pid 4809) died at step 5; rank 0 stops (exit status 4;
    details in runs/x/faults/rank0.txt); resume: torchrun --nproc-per-node 4 -m scalefold train ... --resume

The transport's traceback goes to ``<run>/faults/rank<R>.txt`` (shown with ``--debug``), not the output.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from scalefold.errors import exception_summary

#: exit status of a rank that stopped because another rank failed (or was named as the one at fault)
EXIT_RANK_FAILED = 4
DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_DEAD_PEER_TIMEOUT_S = 20.0
#: beats a rank's heartbeat must miss before an observing rank calls it quiet (after a transport error)
QUIET_BEATS = 3
#: words in a transport error (gloo's, NCCL's, the store's) that say "a peer is gone", besides DistError
_TRANSPORT_WORDS = ("gloo", "nccl", "connection reset", "connection closed", "connection refused", "broken pipe",
                    "timed out", "socket")  # fmt: skip


def heartbeat_interval(stall_timeout_s: float) -> float:
    """Seconds between beats: a twentieth of the stall timeout, within [0.2, 2] s (15 s at the default)."""
    return min(max(stall_timeout_s / 20.0, 0.2), 2.0)


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's or the store's failure (a peer gone), not this rank's own error."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _TRANSPORT_WORDS)


@dataclass
class Fault:
    """The rank at fault (``-1``: none identified), its host and step if known, what happened, who found it."""

    rank: int
    what: str
    host: str | None = None
    pid: int | None = None
    step: int | None = None
    found_by: int = -1

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> Fault:
        return cls(**json.loads(text))

    def describe(self) -> str:
        """``"rank 1 (host node17, pid 4809) died at step 5"``."""
        where = ", ".join(x for x in ((f"host {self.host}" if self.host else ""),
                                      (f"pid {self.pid}" if self.pid else "")) if x)  # fmt: skip
        who = f"rank {self.rank}" + (f" ({where})" if where else "") if self.rank >= 0 else "no rank identified:"
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{who} {self.what}{at}"


class RankFailed(RuntimeError):
    """This rank stops because of another rank's fault: ``line`` is what it says, ``exit_status`` its status."""

    exit_status = EXIT_RANK_FAILED

    def __init__(self, line: str, fault: Fault, detail: str) -> None:
        super().__init__(line)
        self.line, self.fault, self.detail = line, fault, detail


def _pid_state(pid: int) -> str | None:
    """``None``: gone (or a zombie); else the state letter of ``/proc/<pid>/stat`` (``T``: stopped), ``"?"``
    if unknown."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return "?"
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
    return None if state in ("Z", "X") else state  # a zombie is dead, its parent has not reaped it yet


class _Beats:
    """What one rank saw of the others' beats: the value and when (local clock) it last changed."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[bytes, float]] = {}

    def update(self, rank: int, value: bytes, now: float) -> float:
        """Seconds the beat of ``rank`` has been unchanged (0 at the first look)."""
        old = self.seen.get(rank)
        if old is None or old[0] != value:
            self.seen[rank] = (value, now)
            return 0.0
        return now - old[1]


class Heartbeat:
    """This rank's beat and its watch over the others (module docstring). ``store``: a store client used by
    this object alone (its thread and :meth:`explain`); ``eval_ranks``: ranks outside the step loop."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 dead_peer_timeout_s: float = DEFAULT_DEAD_PEER_TIMEOUT_S, interval_s: float | None = None,
                 eval_ranks: tuple[int, ...] = (), fault_dir: str | os.PathLike[str] | None = None,
                 resume: str = "", store_host: str = "", hosts_store: bool = False,
                 exit_fn: Callable[[int], None] = os._exit) -> None:  # fmt: skip
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_timeout_s, self.dead_peer_timeout_s = stall_timeout_s, dead_peer_timeout_s
        self.interval_s = interval_s or heartbeat_interval(stall_timeout_s)
        self.eval_ranks = tuple(eval_ranks)
        self.role = "eval" if rank in self.eval_ranks else "train"
        self.fault_dir = Path(fault_dir) if fault_dir is not None else None
        self.resume, self.store_host, self.hosts_store, self.exit_fn = resume, store_host, hosts_store, exit_fn
        self.host = socket.gethostname()
        self.on_fatal: list[Callable[[], None]] = []  # run before the heartbeat ends a blocked rank
        self._lock = threading.Lock()
        self._n, self._marker, self._step, self._busy = 0, 0, 0, ""
        self._armed = False  # the own-progress watch: from the first completed step on
        self._progress_t = time.monotonic()
        self._beats = _Beats()  # the watched neighbour's beats
        self._scan: _Beats | None = None  # every rank's, while this rank's own progress is stale
        self._scan_t = 0.0
        self._store_failing_since: float | None = None
        self._fault: Fault | None = None
        self._fault_t = 0.0
        self._handled = False  # the main thread took over (explain): the thread ends the process only if that hangs
        self._handled_t = 0.0
        self.ended_with = ""  # the line this rank's heartbeat ended it with
        self._infos: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scalefold-heartbeat", daemon=True)

    # -- the main thread's side ------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        """Publish this rank's host and pid and its first beat, then beat every ``interval_s``."""
        self.store.set(f"info/{self.rank}", json.dumps({"host": self.host, "pid": os.getpid(), "role": self.role}))
        self._beat()
        self._thread.start()
        return self

    def mark(self, step: int, waiting: bool = False) -> None:
        """Progress: in step ``step`` (``waiting``: done with it, waiting for the next batch). Cheap: no I/O."""
        marker = 2 * step + int(waiting)
        with self._lock:
            if marker != self._marker:
                self._marker, self._step, self._progress_t = marker, step, time.monotonic()
            self._armed = self._armed or waiting

    def idle(self) -> None:
        """The step loop ended: this rank's own progress is no longer watched (it is from its first completed
        step on: not in the set-up before, nor in the evaluations, reports and exit barrier after)."""
        with self._lock:
            self._armed = False
            self._progress_t = time.monotonic()

    @contextlib.contextmanager
    def busy(self, phase: str) -> Iterator[None]:
        """A phase that is long on this rank by design (an evaluation, a checkpoint): peers waiting meanwhile
        are not stalled, nor is this rank."""
        with self._lock:
            self._busy = phase
        try:
            yield
        finally:
            with self._lock:
                self._busy, self._progress_t = "", time.monotonic()

    def stop(self, reason: str | None = "done") -> None:
        """This rank leaves (``reason``: ``done``, ``peer``, ``failed: ...``; ``None``: as already told): peers
        stop watching it. The rank whose process holds the store (``hosts_store``: rank 0 under srun / mpirun)
        leaving after a fault first waits, up to ``dead_peer_timeout_s``, for every live rank to have left, so
        that none of them loses the store before it could read the fault."""
        self._stop.set()
        if reason is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"gone/{self.rank}", reason)
        if self.hosts_store and self._fault is not None:
            self._linger()

    def _linger(self) -> None:
        deadline = time.monotonic() + self.dead_peer_timeout_s
        others = [r for r in range(self.world_size) if r != self.rank]
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and any(self._still_here(r, self._gone(others)) for r in others):
                time.sleep(self.interval_s)

    def _still_here(self, rank: int, gone: dict[int, str]) -> bool:
        """``rank`` has not said it left and, on this host, its process lives (elsewhere: unknown, so yes)."""
        if rank in gone:
            return False
        info = self._info(rank)
        if info.get("host") == self.host and info.get("pid"):
            return _pid_state(info["pid"]) is not None
        return True

    def fault(self) -> Fault | None:
        """The run's first fault, if any rank found one."""
        if self._fault is None and self._check(["fault"]):
            self._fault = Fault.decode(self.store.get("fault"))
        return self._fault

    def explain(self, exc: BaseException, claim: bool = True) -> RankFailed | None:
        """This rank's main thread failed with ``exc``: a :class:`RankFailed` naming the rank at fault when
        ``exc`` is a peer's failure (waits up to ``dead_peer_timeout_s`` to identify it), ``None`` when the
        error is this rank's own (with ``claim``, reported to the peers as the fault; its traceback is the
        report; without, e.g. an orderly abort, nothing is reported)."""
        self._handled, self._handled_t = True, time.monotonic()
        try:
            known = self.fault()
        except Exception:  # noqa: BLE001 -- the store is gone: the fault is where it lived
            known = None
        if known is None and not is_transport_error(exc):
            if claim:
                self._own_failure(exc)
            return None
        if not claim and known is not None and known.what.startswith("failed"):
            return None  # an orderly abort for a peer that reported its own error: the abort's message says it
        with contextlib.suppress(Exception):
            self.store.set(f"gone/{self.rank}", "peer")
        _ignore_stop_signals()  # the launcher's SIGTERM to the survivors: this rank ends anyway, with its line
        fault = known or self._identify(exc)
        detail = self._write_detail(fault, exc)
        line = self.line(fault, detail)
        _tell_launcher(line, self.dead_peer_timeout_s + 1)
        return RankFailed(line, fault, detail)

    def line(self, fault: Fault, detail: str | None) -> str:
        """The one line this rank prints for ``fault``."""
        me = "this rank stops" if fault.rank == self.rank else f"rank {self.rank} stops"
        where = f"; details in {detail}" if detail else ""
        resume = f"; resume: {self.resume}" if self.resume else ""
        return f"scalefold train: {fault.describe()}; {me} (exit status {EXIT_RANK_FAILED}{where}){resume}"

    # -- finding the rank at fault ---------------------------------------------------------------------

    def _own_failure(self, exc: BaseException) -> None:
        """Tell the peers that this rank failed by itself (they name it), and claim the fault."""
        with self._lock:
            step = self._step
        what = f"failed ({exception_summary(exc)[:200]})"
        with contextlib.suppress(Exception):
            self.store.set(f"gone/{self.rank}", f"failed: {what}")
            self._post(Fault(self.rank, what, self.host, os.getpid(), step, self.rank))

    def _identify(self, exc: BaseException) -> Fault:
        """The rank at fault after a transport error, within ``dead_peer_timeout_s``."""
        deadline = time.monotonic() + self.dead_peer_timeout_s
        beats = _Beats()
        while True:
            try:
                fault = self.fault() or self._suspect(beats, QUIET_BEATS * self.interval_s, "died")
            except Exception as store_exc:  # noqa: BLE001 -- the store's host is gone too
                return self._store_lost(store_exc)
            if fault is not None:
                return self._post(fault)
            if time.monotonic() > deadline:
                return self._post(Fault(-1, f"a collective failed ({exception_summary(exc)[:160]}) and no peer "
                                        f"was found dead within {self.dead_peer_timeout_s:g} s", found_by=self.rank))  # fmt: skip
            time.sleep(self.interval_s / 2)

    def _suspect(self, beats: _Beats, quiet_s: float, verb: str, ranks: list[int] | None = None) -> Fault | None:
        """A rank that failed by itself, whose process is gone (this host), or whose beat is quiet for ``quiet_s``."""
        ranks = [r for r in (ranks if ranks is not None else range(self.world_size)) if r != self.rank]
        gone = self._gone(ranks)
        for r in ranks:
            if gone.get(r, "").startswith("failed"):
                return self._fault_of(r, gone[r].split(": ", 1)[1])
        now = time.monotonic()
        live = [r for r in ranks if r not in gone]
        values = self._get_many([f"beat/{r}" for r in live])
        for r, value in zip(live, values):
            if value is None:
                continue
            info = self._info(r)
            state = _pid_state(info["pid"]) if info.get("host") == self.host and info.get("pid") else "?"
            quiet = beats.update(r, value, now)
            if state is None:
                return self._fault_of(r, "died (its process is gone)", value)
            if quiet >= quiet_s:
                stopped = " (its process is stopped)" if state == "T" else ""
                return self._fault_of(r, f"sent no heartbeat for {quiet:.0f} s{stopped}", value)
        return None

    def _fault_of(self, rank: int, what: str, beat: bytes | None = None) -> Fault:
        info = self._info(rank)
        if beat is None:
            beat = self._get_many([f"beat/{rank}"])[0]
        step = int(beat.split()[2]) if beat else None
        return Fault(rank, what, info.get("host"), info.get("pid"), step, self.rank)

    def _store_lost(self, exc: BaseException) -> Fault:
        where = f" at {self.store_host}" if self.store_host else ""
        return Fault(0, f"is unreachable: the rendezvous store{where} it hosts does not answer ({exception_summary(exc)[:120]})",
                     found_by=self.rank)  # fmt: skip

    def _post(self, fault: Fault) -> Fault:
        """Set the run's fault unless another rank did first; the run's (first) fault."""
        with contextlib.suppress(Exception):
            self._fault = Fault.decode(self.store.compare_set("fault", "", fault.encode()))
            return self._fault
        return fault

    # -- store helpers ---------------------------------------------------------------------------------

    def _check(self, keys: list[str]) -> bool:
        return bool(self.store.check(keys))

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        """Values of ``keys`` (``None`` for a key not set: no blocking get on a missing key)."""
        present = [k for k in keys if self._check([k])]
        if hasattr(self.store, "multi_get") and present:
            values = dict(zip(present, self.store.multi_get(present)))
        else:
            values = {k: self.store.get(k) for k in present}
        return [values.get(k) for k in keys]

    def _gone(self, ranks: list[int]) -> dict[int, str]:
        values = self._get_many([f"gone/{r}" for r in ranks])
        return {r: v.decode() for r, v in zip(ranks, values) if v is not None}

    def _info(self, rank: int) -> dict:
        """Host, pid and role of ``rank`` (read once: they do not change)."""
        if rank not in self._infos:
            value = self._get_many([f"info/{rank}"])[0]
            if not value:
                return {}
            self._infos[rank] = json.loads(value)
        return self._infos[rank]

    # -- the heartbeat thread --------------------------------------------------------------------------

    def _beat(self) -> None:
        with self._lock:
            self._n += 1
            value = f"{self._n} {self._marker} {self._step} {self._busy or '-'}"
        self.store.set(f"beat/{self.rank}", value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                self._watch()
                self._store_failing_since = None
            except Exception as exc:  # noqa: BLE001 -- the store does not answer
                self._store_trouble(exc)

    def _store_trouble(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._store_failing_since is None:
            self._store_failing_since = now
        elif now - self._store_failing_since > self.stall_timeout_s and self._fault is None:
            self._fault, self._fault_t = self._store_lost(exc), now
        if self._fault is not None:
            self._end_if_blocked()

    def _watch(self) -> None:
        fault = self.fault()
        if fault is None and self.world_size > 1:
            buddy = (self.rank + 1) % self.world_size
            fault = self._suspect(self._beats, self.stall_timeout_s, "stalled", [buddy])
            fault = fault or self._own_progress()
            if fault is not None:
                fault = self._post(fault)
        if fault is not None:
            self._end_if_blocked()

    def _own_progress(self) -> Fault | None:
        """This rank made no progress for ``stall_timeout_s`` (outside a busy phase): find who holds it up."""
        with self._lock:
            waited = time.monotonic() - self._progress_t
            stale = self._armed and not self._busy and self.role == "train" and waited > self.stall_timeout_s
        if not stale:
            self._scan = None
            return None
        if self._scan is None:  # read every beat now and again three beats later: who is quiet, who is behind
            self._scan, self._scan_t = _Beats(), time.monotonic()
        fault = self._suspect(self._scan, QUIET_BEATS * self.interval_s, "stalled")
        if fault is not None or time.monotonic() - self._scan_t < QUIET_BEATS * self.interval_s:
            return fault
        return self._behind(waited)

    def _behind(self, waited: float) -> Fault | None:
        """Every rank beats: the training rank furthest behind, unless one is busy by design (wait on)."""
        gone = self._gone(list(range(self.world_size)))
        ranks = [r for r in range(self.world_size) if r not in self.eval_ranks and r not in gone]
        beats = {r: v.decode().split() for r, v in zip(ranks, self._get_many([f"beat/{r}" for r in ranks])) if v}
        if any(b[3] != "-" for b in beats.values()):
            self._scan = None
            with self._lock:
                self._progress_t = time.monotonic()
            return None
        markers = {r: int(b[1]) for r, b in beats.items()}
        low = min(markers, key=lambda r: (markers[r], r))
        if markers[low] == max(markers.values()):
            return Fault(-1, f"every rank is alive but none made progress for {waited:.0f} s (a collective that "
                         "never completes)", step=int(beats[low][2]), found_by=self.rank)  # fmt: skip
        phase = "waiting for its batch" if markers[low] % 2 else "in its step"
        return self._fault_of(low, f"made no progress for {waited:.0f} s ({phase} while its peers wait)")

    def _end_if_blocked(self) -> None:
        """A fault is known: give the main thread ``dead_peer_timeout_s`` to end by itself, then end the rank."""
        now = time.monotonic()
        if not self._fault_t:
            self._fault_t = now
        if now - self._fault_t < self.dead_peer_timeout_s:
            return
        if self._handled and now - self._handled_t < 2 * self.dead_peer_timeout_s:
            return  # the main thread ends the rank itself (a safety net should its exit hang)
        fault = self._fault
        with self._lock:
            moving = now - self._progress_t < self.dead_peer_timeout_s or bool(self._busy)
        if fault.rank in self.eval_ranks and self.role == "train" and moving:
            return  # training goes on to the end of its cycle, where the lost evaluation ends it (one line)
        detail = self._write_detail(fault, None)
        line = self.line(fault, detail) + f" [its main thread was still blocked after {self.dead_peer_timeout_s:g} s]"
        _tell_launcher(line, self.dead_peer_timeout_s + 1)
        _say(line)
        self.ended_with = line
        for hook in self.on_fatal:
            with contextlib.suppress(Exception):
                hook()
        with contextlib.suppress(Exception):
            self.store.set(f"gone/{self.rank}", "peer")
        self.exit_fn(EXIT_RANK_FAILED)

    def _write_detail(self, fault: Fault, exc: BaseException | None) -> str | None:
        """``<fault_dir>/rank<R>.txt``: the fault, this rank's exception (the transport's traceback) and every
        thread's Python stack. The path, or None where it cannot be written (no run directory, a full disk)."""
        if self.fault_dir is None:
            return None
        path = self.fault_dir / f"rank{self.rank}.txt"
        try:
            self.fault_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{fault.describe()} (found by rank {fault.found_by}); this rank: {self.rank} on {self.host}, "
                        f"pid {os.getpid()}, step {self._step}\n\n")  # fmt: skip
                if exc is not None:
                    f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            return None
        return str(path)


class NoHeartbeat:
    """A run of one process (or without a store): the same calls, nothing watched."""

    def __init__(self) -> None:
        self.on_fatal: list[Callable[[], None]] = []

    def mark(self, step: int, waiting: bool = False) -> None:
        pass

    def idle(self) -> None:
        pass

    @contextlib.contextmanager
    def busy(self, phase: str) -> Iterator[None]:
        yield

    def stop(self, reason: str | None = "done") -> None:
        pass

    def explain(self, exc: BaseException, claim: bool = True) -> RankFailed | None:
        return None


def _say(line: str) -> None:
    """One line on standard error, in one write (ranks share the launcher's pipe)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", errors="replace"))
    except (AttributeError, OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _ignore_stop_signals() -> None:
    """SIGTERM ignored from here to the exit of a rank that ends for a peer's fault: torchrun sends it to every
    survivor as soon as one worker died, and a survivor ended by it would say nothing (torchrun's SIGKILL
    follows 30 s later; ``dead_peer_timeout_s`` bounds this rank's end before that). Main thread only."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _tell_launcher(line: str, after_s: float = 0.0) -> None:
    """torchrun's error file (``TORCHELASTIC_ERROR_FILE``), where it has one: its failure summary then shows
    ``line`` -- the rank at fault -- for this rank, rather than "To enable traceback see ...". The file is dated
    ``after_s`` seconds on: a survivor's failure is a consequence, so torchrun's "first observed failure" is
    the rank at fault where it exited (killed), and otherwise (a stopped rank never exits) the first survivor,
    whose message names it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time() + after_s))
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}}
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump(data, f)


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the rendezvous store at ``host:port`` for the heartbeat alone (its own connection and
    timeout), keys under ``scalefold/faults/<torchrun restart attempt>/``."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"scalefold/faults/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


__all__ = [
    "DEFAULT_DEAD_PEER_TIMEOUT_S", "DEFAULT_STALL_TIMEOUT_S", "EXIT_RANK_FAILED", "Fault", "Heartbeat", "NoHeartbeat",
    "RankFailed",
    "connect_store", "heartbeat_interval", "is_transport_error",
]  # fmt: skip
