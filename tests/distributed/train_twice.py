"""Test-only driver: two ``scalefold train`` runs, one after the other, in the same ranks of ONE launch.

``torchrun --nproc-per-node N tests/distributed/train_twice.py PORT ARGS_A... --then ARGS_B...`` runs
``scalefold train ARGS_A`` on every rank, then ``scalefold train ARGS_B`` (each through the command's own
entry, :func:`scalefold.cli.main`, which forms and tears down its process group). The second run meets at a
rendezvous of its own: a store that rank 0 hosts on ``PORT`` (a fresh one, as under ``srun`` / ``mpirun``),
not the launcher's store the first run used, so no key of the first run's process group or heartbeat is seen
by the second. The launch costs the ranks' start (interpreter, imports, forkserver) once instead of twice;
the tests that compare an eager run with a graphed one (tests/distributed/test_whole_step_layouts.py) use it.
The exit status is the first non-zero one of the two runs (the second does not start after a failed first).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    """Run both commands of ``argv`` (``PORT ARGS_A... --then ARGS_B...``); their first non-zero status."""
    from scalefold.cli import main as scalefold_main

    port, rest = argv[0], argv[1:]
    split = rest.index("--then")
    first, second = rest[:split], rest[split + 1 :]
    status = scalefold_main(["train", *first])
    if status:
        return status
    # the second run's rendezvous: rank 0 hosts a fresh store on PORT (the launcher's store keeps the first's keys)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ["MASTER_PORT"] = port
    return scalefold_main(["train", *second])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
