"""Run a function on ``world_size`` local gloo processes (tests, benchmarks, CPU experiments)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it): ScaleFold's one free-port helper, for a local
    launch's rendezvous (loopback) and an MPI launch's master (``""``: every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # every rank's collectives are complete before any rank tears its group down: a peer
        # closing its sockets under gloo's transport threads aborts them ("terminate called
        # without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # success: leave without the interpreter's teardown, where gloo's remaining transport threads
    # can still race the process exit (rare SIGABRT after a passed run); failures raise above and
    # reach torch.multiprocessing's error reporting as usual
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined by a gloo default
    group; raises if any of them fails. ``fn`` must be picklable (a module-level function)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mp.spawn(_entry, args=(fn, world_size, free_port(), threads, args), nprocs=world_size, join=True)


__all__ = ["free_port", "run_processes"]
