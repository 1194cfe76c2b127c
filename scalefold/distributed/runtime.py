"""Distributed runtime: rank discovery (torchrun / Slurm / MPI), process groups, device.

One code path whatever launched us:

* **torchrun** / ``python -m torch.distributed.run``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
* **Slurm** ``srun`` (ScaleFold's ``run.sub`` launches without torchrun): ``SLURM_PROCID``,
  ``SLURM_NTASKS``/``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_NODELIST`` -> the master is
  the first node of the node list (``scontrol show hostnames``, or parsed here), the port derived
  from the job id;
* **MPI** ``mpirun``: Open MPI ``OMPI_COMM_WORLD_*``, MPICH/Hydra ``PMI_RANK``/``PMI_SIZE``,
  PMIx ``PMIX_RANK``; without ``MASTER_ADDR`` the master address and port are broadcast with mpi4py.

Discovery is a pure function of an environment mapping (:func:`discover`), so it is unit-tested with
plain dicts. :func:`init_distributed` validates the rank layout against the discovered world size
(before anything starts), initialises ``torch.distributed`` (NCCL on GPU, gloo on CPU) and builds every
process group once, in :class:`~scalefold.distributed.context.ParallelContext` (``Runtime.parallel``):
the training ranks, the evaluation ranks (the last ``num_async_eval_ranks``), the gloo "bridge" between
training rank 0 and the first evaluation rank (the SWA weights travel through it, in host memory), and
the DAP / BP / model groups.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scalefold.distributed.context import ParallelContext, build_parallel_context
from scalefold.distributed.heartbeat import DEFAULT_DEAD_PEER_TIMEOUT_S, Heartbeat, NoHeartbeat, connect_store
from scalefold.distributed.launch import free_port
from scalefold.distributed.layout import ParallelLayout
from scalefold.errors import UserError, exception_summary

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Slurm jobs derive their port from the job id so concurrent jobs sharing a node don't collide.
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 20000
DEFAULT_TIMEOUT_S = 1800


class LaunchError(UserError, RuntimeError):
    """The launch environment cannot be used as it is (e.g. ``mpirun`` without mpi4py)."""

    label = "launch error"


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits, as the launcher told us."""

    launcher: str  # "single" | "torchrun" | "slurm" | "mpi"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    num_nodes: int = 1
    master_addr: str | None = None  # None: to be resolved (Slurm node list, mpi4py broadcast)
    master_port: int | None = None


# ----------------------------------------------------------------------------------------------
# Discovery (pure functions of the environment)
# ----------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``"gpu[001-003,7],login1"`` -> ``["gpu001", "gpu002", "gpu003", "gpu7", "login1"]``."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts.extend(_expand_host(item.strip()))
    return [h for h in hosts if h]


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    out = []
    for part in match.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            values = [part]
        for value in values:
            out.extend(_expand_host(head + value + tail))
    return out


def _slurm_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` like ``"8(x2),4"`` -> ``[8, 8, 4]``."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def discover(env: Mapping[str, str] | None = None) -> RankInfo:
    """Rank information from the environment (torchrun > Slurm step > MPI > single process)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
        return RankInfo(
            launcher="torchrun", rank=int(env["RANK"]), world_size=world,
            local_rank=_int(env, "LOCAL_RANK", default=0), local_world_size=local_world,
            num_nodes=_ceil_div(world, max(local_world, 1)),
            master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
            master_port=_int(env, "MASTER_PORT", default=DEFAULT_MASTER_PORT),
        )  # fmt: skip
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=1)
        per_node = _slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
        node_id = _int(env, "SLURM_NODEID", default=0)
        local_world = per_node[node_id] if node_id < len(per_node) else _ceil_div(world, nodes)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        job_id = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
        port = _int(env, "MASTER_PORT")
        if port is None:
            port = SLURM_PORT_BASE + job_id % SLURM_PORT_RANGE if job_id is not None else DEFAULT_MASTER_PORT
        master = env.get("MASTER_ADDR")
        if master is None and nodelist:
            master = expand_slurm_nodelist(nodelist)[0]
        return RankInfo(
            launcher="slurm", rank=int(env["SLURM_PROCID"]), world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", default=0), local_world_size=local_world,
            num_nodes=nodes, master_addr=master, master_port=port,
        )  # fmt: skip
    mpi_rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if mpi_rank is not None:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_WORLD_SIZE", "SLURM_NTASKS", default=1)
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
        return RankInfo(
            launcher="mpi", rank=mpi_rank, world_size=world,
            local_rank=local_rank if local_rank is not None else -1,  # -1: derive with mpi4py
            local_world_size=local_world if local_world is not None else -1,
            num_nodes=_ceil_div(world, local_world) if local_world else -1,
            master_addr=env.get("MASTER_ADDR"), master_port=_int(env, "MASTER_PORT"),
        )  # fmt: skip
    return RankInfo(launcher="single")


def resolve_slurm_master(nodelist: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """First host of ``nodelist``: ``scontrol show hostnames`` when available, else parsed here."""
    if shutil.which("scontrol"):
        proc = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.split()[0]
    return expand_slurm_nodelist(nodelist)[0]


def complete_with_mpi(info: RankInfo) -> RankInfo:
    """Fill what MPI variables lack (master address/port, local rank) with mpi4py collectives.

    Raises :class:`LaunchError` (how to fix it) when mpi4py is not installed."""
    try:
        from mpi4py import MPI  # optional dependency (extra "mpi")
    except ImportError as exc:
        lacking = [what for what, missing in (("MASTER_ADDR", info.master_addr is None),
                   ("MASTER_PORT", info.master_port is None), ("the local rank", info.local_rank < 0)) if missing]  # fmt: skip
        raise LaunchError(
            f"launched by an MPI launcher (rank {info.rank} of {info.world_size}) without {', '.join(lacking)}: "
            f"scalefold needs mpi4py to exchange them ({exc}). Install it with `pip install 'scalefold[mpi]'` "
            "(or `pip install mpi4py`), or export MASTER_ADDR and MASTER_PORT (and a local-rank variable such as "
            "OMPI_COMM_WORLD_LOCAL_RANK) to every rank, or launch with torchrun / srun"
        ) from exc

    comm = MPI.COMM_WORLD
    master_addr, master_port = info.master_addr, info.master_port
    if master_addr is None or master_port is None:
        master = (socket.gethostname(), free_port("")) if comm.Get_rank() == 0 else None
        master_addr, master_port = comm.bcast(master, root=0)
    local_rank, local_world, nodes = info.local_rank, info.local_world_size, info.num_nodes
    if local_rank < 0 or local_world < 0:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_world = node_comm.Get_rank(), node_comm.Get_size()
        nodes = comm.allreduce(1 if local_rank == 0 else 0)
        node_comm.Free()
    return RankInfo(
        launcher="mpi", rank=comm.Get_rank(), world_size=comm.Get_size(), local_rank=local_rank,
        local_world_size=local_world, num_nodes=nodes, master_addr=master_addr, master_port=master_port,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The runtime
# ----------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """The process the run lives in: its rank as the launcher told it, its device, and ``parallel``, the
    one owner of the rank layout and of every process group (roles, sizes, groups: ask it)."""

    launcher: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    num_nodes: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: torch.distributed not initialised (single process)
    parallel: ParallelContext = field(default_factory=lambda: ParallelContext(ParallelLayout(1), rank=0))
    #: liveness of the ranks (:mod:`scalefold.distributed.heartbeat`; a no-op in a single process)
    heartbeat: Heartbeat | NoHeartbeat = field(default_factory=NoHeartbeat)

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def cuda_device_index(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The GPU of a node's ``local_rank``. One visible GPU serves every local rank (the launcher binds one
    GPU per task: ``srun --gpus-per-task=1``, per-task ``CUDA_VISIBLE_DEVICES``); with several visible,
    local rank i takes GPU i, and more ranks than GPUs is refused (NCCL allows one rank per GPU; two ranks
    on a GPU would otherwise fail later with NCCL's "Duplicate GPU detected")."""
    if device_count > 1 and local_world_size > device_count:
        raise RuntimeError(
            f"{local_world_size} ranks on this node but {device_count} visible GPUs: NCCL needs one GPU per rank "
            "(start at most as many tasks per node as GPUs, evaluation ranks included, or bind one GPU per task)"
        )
    return local_rank % device_count


def select_device(local_rank: int, local_world_size: int = 1) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", cuda_device_index(local_rank, local_world_size, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(
    num_async_eval_ranks: int = 0,
    env: Mapping[str, str] | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    dap: int = 1,
    bp: int = 1,
    parallel_evoformer: bool = False,
    crop_size: int | None = None,
    stall_timeout_s: float | None = None,
    dead_peer_timeout_s: float = DEFAULT_DEAD_PEER_TIMEOUT_S,
    fault_dir: str | os.PathLike[str] | None = None,
    resume: str = "",
    preflight: Callable[[ParallelLayout, torch.device, int], None] | None = None,
) -> Runtime:
    """Discover ranks, validate the layout (:class:`~scalefold.distributed.layout.LayoutError` before any
    process group exists), initialise ``torch.distributed`` when there is more than one rank, build the groups.

    ``timeout_s``: timeout of the process group's collectives (``TrainConfig.process_group_timeout_s``).
    ``stall_timeout_s``: with several ranks, start the heartbeat (``Runtime.heartbeat``) that names a dead or
    stalled rank (``dead_peer_timeout_s``, ``fault_dir``, ``resume``: the command its line names;
    :class:`~scalefold.distributed.heartbeat.Heartbeat`). ``preflight(layout, device, rank)``: the caller's
    configuration checks that need the layout or the device, run on every rank before the process group forms
    (a mistake raised there ends each rank with its own one line, no collective, no heartbeat)."""
    info = discover(env)
    if info.launcher == "mpi" and (info.master_addr is None or info.master_port is None or info.local_rank < 0):
        info = complete_with_mpi(info)
    layout = ParallelLayout(info.world_size, dap=dap, bp=bp, num_eval_ranks=num_async_eval_ranks)
    layout.validate(parallel_evoformer=parallel_evoformer, crop_size=crop_size)
    env_map = os.environ if env is None else env
    nodelist = env_map.get("SLURM_STEP_NODELIST") or env_map.get("SLURM_JOB_NODELIST") or env_map.get("SLURM_NODELIST")
    if info.launcher == "slurm" and "MASTER_ADDR" not in env_map and nodelist:
        info = dataclasses.replace(info, master_addr=resolve_slurm_master(nodelist))  # scontrol if present
    device = select_device(info.local_rank, info.local_world_size)
    if preflight is not None:
        preflight(layout, device, info.rank)
    runtime = Runtime(
        launcher=info.launcher, rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        local_world_size=info.local_world_size, num_nodes=info.num_nodes, device=device,
    )  # fmt: skip
    if info.world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":  # a dead peer ends the run, not hangs it (docs/faults.md); before NCCL starts
            for key, value in nccl_fault_environment(fault_dir, env_map).items():
                os.environ.setdefault(key, value)
            if fault_dir is not None:  # the flight recorder's dumps go there
                Path(fault_dir).mkdir(parents=True, exist_ok=True)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{info.master_addr or DEFAULT_MASTER_ADDR}:{info.master_port}",
            rank=info.rank, world_size=info.world_size, timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        runtime.backend = backend
    elif dist.is_initialized():
        runtime.backend = dist.get_backend()
    runtime.parallel = build_parallel_context(layout, ranks_per_node=info.local_world_size)
    if runtime.distributed and stall_timeout_s is not None:
        runtime.heartbeat = _start_heartbeat(runtime, info, stall_timeout_s, dead_peer_timeout_s, fault_dir,
                                             resume or resume_command(info))  # fmt: skip
    return runtime


def nccl_fault_environment(fault_dir: str | os.PathLike[str] | None = None,
                           env: Mapping[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    """The NCCL settings under which a dead or hung peer ends the run instead of hanging it, for those ``env``
    does not set already (the user's values win): the watchdog aborts a collective that fails or passes the
    process group's timeout and tears the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``), its own
    heartbeat monitor ends a rank whose watchdog hangs (``TORCH_NCCL_ENABLE_MONITORING=1``), and the flight
    recorder's last collectives are dumped on a timeout, into the run's ``faults/`` folder when known."""
    env = os.environ if env is None else env
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
              "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # fmt: skip
    if fault_dir is not None:
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(fault_dir) / "nccl_trace_rank_")
    return {k: v for k, v in wanted.items() if k not in env}


def _start_heartbeat(runtime: Runtime, info: RankInfo, stall_timeout_s: float, dead_peer_timeout_s: float,
                     fault_dir: str | os.PathLike[str] | None, resume: str) -> Heartbeat | NoHeartbeat:  # fmt: skip
    """The heartbeat over a client of the rendezvous store of its own; a store that cannot be reached costs
    one line (the run goes on, its dead or stalled ranks unnamed)."""
    host, port = info.master_addr or DEFAULT_MASTER_ADDR, int(info.master_port or DEFAULT_MASTER_PORT)
    try:
        store = connect_store(host, port, timeout_s=max(5.0, min(30.0, stall_timeout_s)))
        return Heartbeat(store, runtime.rank, runtime.world_size, stall_timeout_s=stall_timeout_s,
                         dead_peer_timeout_s=dead_peer_timeout_s, eval_ranks=tuple(runtime.parallel.eval_ranks),
                         fault_dir=fault_dir, resume=resume, store_host=f"{host}:{port}",
                         hosts_store=runtime.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                         ).start()  # fmt: skip
    except (RuntimeError, OSError) as exc:
        print(f"scalefold: rank {runtime.rank}: no heartbeat (the store at {host}:{port}: {exception_summary(exc)}); "
              "a dead or stalled rank will not be named", file=sys.stderr, flush=True)  # fmt: skip
        return NoHeartbeat()


def resume_command(info: RankInfo | None = None, argv: list[str] | None = None,
                   default_args: list[str] | None = None) -> str:  # fmt: skip
    """The command that continues this run from its newest checkpoint: this process's ``scalefold train``
    arguments (``argv``, default ``sys.argv[1:]``; ``default_args`` where they are not a ``train`` command
    line: an in-process call) with ``--resume`` and without ``--overwrite``, behind the launcher that started
    it (``info``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "train" not in args[:2] and default_args is not None:
        args = list(default_args)
    args = [a for a in args if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    info = info or discover()
    if info.launcher == "torchrun":
        nodes = f"--nnodes {info.num_nodes} (and the same rendezvous) " if info.num_nodes > 1 else ""
        launch = f"torchrun {nodes}--nproc-per-node {info.local_world_size} -m scalefold"
    elif info.launcher == "slurm":
        launch = f"srun --ntasks {info.world_size} scalefold"
    elif info.launcher == "mpi":
        launch = f"mpirun -n {info.world_size} scalefold"
    else:
        launch = "scalefold"
    return f"{launch} {shlex.join(args)}"


#: seconds a cleanly finished rank waits at the exit barrier for its peers (gloo) before it leaves anyway
SHUTDOWN_BARRIER_TIMEOUT_S = 120.0


def shutdown(runtime: Runtime, clean: bool = True, barrier_timeout_s: float = SHUTDOWN_BARRIER_TIMEOUT_S) -> None:
    """Tear the process group down. After a clean finish (``clean``: this rank's run returned), gloo
    ranks first meet at a barrier, so that no rank closes its sockets while a peer's transport threads
    still talk to it (that can abort a process at exit: "terminate called without an active
    exception"). The barrier is ``monitored_barrier`` with ``barrier_timeout_s``: a peer that died or
    failed cannot hang the exit; a barrier that fails is reported on stderr and the rank leaves anyway.
    NCCL groups are destroyed directly (no barrier with a timeout there); a rank leaving on an exception
    never waits."""
    runtime.heartbeat.stop("done" if clean else None)  # a clean rank is not watched while it waits to leave
    if not (runtime.distributed and dist.is_initialized()):
        return
    try:
        if clean and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
            except RuntimeError as exc:  # a peer did not arrive in time (it failed, or is gone)
                print(f"scalefold: rank {runtime.rank}: exit barrier failed after {barrier_timeout_s:g} s "
                      f"({exception_summary(exc)}); leaving without it", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()
        runtime.backend = None
