"""Inject a fault into a running DAP-2 x DP-2 ``scalefold train`` (tiny preset, torchrun, gloo, 4 processes)
and print what the survivors say: the evidence of docs/faults.md.

    python bench/fault_injection.py --signal SIGKILL --rank 2 [--out runs/fault-kill]
    python bench/fault_injection.py --signal SIGSTOP --rank 2 [--out runs/fault-stop]

Starts ``torchrun --nproc-per-node 4 -m scalefold train --preset tiny --dap 2 --stall-timeout 6
--dead-peer-timeout 10 --checkpoint-every 2 ...``, waits for 3 completed steps, sends the signal to the rank's
process, waits for the other ranks to end (a stopped rank is then continued and killed), and prints the
launch's output without torch's C++ warnings, the seconds from the signal to the survivors' exit and
torchrun's exit status. Any machine with the CPU wheel; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ranks(launcher_pid: int) -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry.name)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal", default="SIGKILL", choices=("SIGKILL", "SIGSTOP", "SIGTERM"))
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--out", default="runs/fault-injection")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", SCALEFOLD_COUNT_FLOPS="0", PYTHONPATH=str(REPO))
    cmd = ["torchrun", "--nproc-per-node", "4", "-m", "scalefold", "train", "--preset", "tiny", "--dap", "2",
           "--out", str(out), "--max-steps", "100000", "--eval-every", "0", "--checkpoint-every", "2",
           "--num-workers", "1", "--no-progress", "--stall-timeout", "6", "--dead-peer-timeout", "10"]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and proc.poll() is None:
        time.sleep(0.2)
    pids = _ranks(proc.pid)
    t0 = time.monotonic()
    os.kill(pids[args.rank], getattr(signal, args.signal))
    print(f"# {args.signal} sent to rank {args.rank} (pid {pids[args.rank]}) after step 3", flush=True)
    others = [p for r, p in pids.items() if r != args.rank]
    while any(_alive(p) for p in others) and time.monotonic() - t0 < 300:
        time.sleep(0.2)
    ended = time.monotonic() - t0
    if args.signal == "SIGSTOP":
        for sig in (signal.SIGCONT, signal.SIGKILL):
            os.kill(pids[args.rank], sig)
    output, _ = proc.communicate(timeout=300)
    noise = re.compile(r"^(\[W\d|W\d{4} |.*socket\.cpp|.*\[c10d\])")
    print("\n".join(line for line in output.splitlines() if not noise.match(line)))
    print(f"# the other ranks ended {ended:.1f} s after the signal; torchrun's exit status: {proc.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
