"""The headline's processes: each configuration in a child killed at its cap, whose row is kept the moment
the child prints it (``ROW {json}``, before its profile; ``EXTRA {json}`` lines add the profile and the
trace later), and the CPU estimates (memory model, FLOP count) run meanwhile, each with its own cap, their
output and errors in files that come back (``<out>/estimates/<key>.json`` / ``.err``), never waited for past
the deadline. Rehearsal faults (``SCALEFOLD_REHEARSE_FAULT``, comma-separated): ``raise:<config>`` (the
child raises before its build), ``hang-profile:<config>`` (the child hangs in its profile, after its row:
the cap lands mid-profile), ``late-estimate:<key>`` (that estimate never answers)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

FAULT_ENV = "SCALEFOLD_REHEARSE_FAULT"


def faults(kind: str, env: dict | None = None) -> set[str]:
    """The names ``SCALEFOLD_REHEARSE_FAULT`` gives fault ``kind`` (e.g. ``raise`` -> {"compile"})."""
    spec = (os.environ if env is None else env).get(FAULT_ENV, "")
    return {item.split(":", 1)[1] for item in spec.split(",") if item.startswith(kind + ":") and ":" in item}


def run_capped(cmd: list[str], cap: float, on_row: Callable[[dict], None] | None = None) -> tuple[dict | None, str]:
    """Run a child, its output passed through; ``(row, status)``. ``ROW {json}`` is the row (handed to
    ``on_row`` at once), ``EXTRA {json}`` lines are merged into it. Killed at ``cap`` seconds (SIGINT, then
    SIGKILL 5 s later): a row printed before the cap is kept (status ``ok, cap reached after the row``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    row, deadline = None, time.monotonic() + cap
    killer = threading.Timer(cap, lambda: _stop(proc))
    killer.start()
    try:
        for line in proc.stdout:
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                if on_row is not None:
                    on_row(row)
            elif line.startswith("EXTRA ") and row is not None:
                row.update(json.loads(line[6:]))
            else:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        killer.cancel()
    capped = time.monotonic() >= deadline - 1
    if row is not None:
        return row, "ok, cap reached after the row" if capped else "ok"
    return None, "cap reached" if capped else f"exit {proc.returncode}"


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()


def _nice() -> None:  # the estimates yield the CPUs to the configurations (a host-issue-bound step)
    os.nice(10)


class Estimates:
    """The CPU estimates, started at once in parallel (``CUDA_VISIBLE_DEVICES=""``), each killed at ``cap``
    seconds; stdout to ``<folder>/<key>.json``, stderr to ``<folder>/<key>.err``. ``reuse``: a folder of
    earlier answers (``<key>-<hash of the command>.json``, e.g. computed on a CPU machine beforehand and
    carried): a matching one is taken instead of running the command."""

    def __init__(self, commands: dict[str, list[str]], folder: Path, cap: float, reuse: Path | None = None):
        self.folder, self.cap, self.reuse = folder, cap, reuse
        self.results: dict[str, dict] = {}
        self.late: dict[str, str] = {}
        self.procs: dict[str, tuple[subprocess.Popen, float, list[str]]] = {}
        folder.mkdir(parents=True, exist_ok=True)
        late = faults("late-estimate")
        for key, cmd in commands.items():
            if self._reused(key, cmd):
                continue
            run = [sys.executable, "-c", "import time; time.sleep(3600)"] if key in late else cmd
            with open(folder / f"{key}.json", "w") as out, open(folder / f"{key}.err", "w") as err:
                proc = subprocess.Popen(run, stdout=out, stderr=err, preexec_fn=_nice,
                                        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
            self.procs[key] = (proc, time.monotonic(), cmd)

    @staticmethod
    def cache_name(key: str, cmd: list[str]) -> str:
        return f"{key}-{hashlib.sha1(json.dumps(cmd[1:]).encode()).hexdigest()[:10]}.json"

    def _reused(self, key: str, cmd: list[str]) -> bool:
        if self.reuse is None:
            return False
        path = self.reuse / self.cache_name(key, cmd)
        try:
            self.results[key] = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        print(f"estimate {key}: reused {path}", flush=True)
        return True

    def poll(self, until: float | None = None) -> dict[str, dict]:
        """Collect what is in; with ``until`` (a ``time.monotonic()``), wait for the rest until then at most
        (and each until its own cap), then kill what is left and report it late. Returns the results."""
        for key, (proc, t0, cmd) in list(self.procs.items()):
            end = t0 + self.cap if until is None else min(t0 + self.cap, until)
            if until is not None and proc.poll() is None:
                try:
                    proc.wait(timeout=max(end - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None and time.monotonic() < end:
                continue
            del self.procs[key]
            self._finish(key, proc, t0, cmd)
        return self.results

    def _finish(self, key: str, proc: subprocess.Popen, t0: float, cmd: list[str]) -> None:
        waited = time.monotonic() - t0
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            self.late[key] = f"late: no answer in {waited:.0f} s (killed; its cap {self.cap:.0f} s or the deadline)"
        else:
            try:
                self.results[key] = json.loads((self.folder / f"{key}.json").read_text())
            except (OSError, ValueError):
                self.late[key] = f"failed: exit {proc.returncode} after {waited:.0f} s (stderr: estimates/{key}.err)"
        if key in self.results:
            if self.reuse is not None:
                self.reuse.mkdir(parents=True, exist_ok=True)
                (self.reuse / self.cache_name(key, cmd)).write_text(json.dumps(self.results[key]))
            print(json.dumps({"estimate": key, "in_by_s": round(waited, 1)}), flush=True)
        else:
            print(f"estimate {key}: {self.late[key]}", flush=True)

    def stop(self) -> None:
        """Kill whatever still runs (the driver's end)."""
        for proc, _, _ in self.procs.values():
            proc.kill()
            proc.wait()
