"""Helper to run a function on N CPU processes with the gloo backend (for tests)."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    # A C++ abort in a worker prints the Python stack of every thread, on the process's own
    # stderr (a forked worker inherits pytest's sys.stderr, which may have no file descriptor).
    faulthandler.enable(file=sys.__stderr__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # the machine is shared: every worker on one thread
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears down its connections while another still uses them
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world: int = 2, *args: Any,
                    start_method: str = "spawn") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; raises if any fails.
    ``fn`` must be a module-level function (it is pickled). ``start_method="fork"``: the
    processes are forks of this one (no fresh interpreter importing torch and the test module,
    seconds each) for a check of what the processes compute together, not of how they start."""
    mp.start_processes(_worker, args=(world, _free_port(), fn, args), nprocs=world, join=True,
                       start_method=start_method)
