"""Process-group setup that works as a single process, under the deepspeed launcher, torchrun or SLURM.

Neutral ground: train/ and checkpoint/ both use it, and it imports neither (checkpoint code must not depend on
the train package).
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def skip_cpu_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory collective op.

    Only DeepSpeed's inference all-reduce uses that op (training goes through torch.distributed/gloo), yet its
    backend builds it on every CPU start: a C++ compile per fresh machine, and a build killed half-way leaves a
    lock in the torch extensions folder on which every later start waits forever.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


DEFAULT_TIMEOUT_MINUTES = 30.0


def under_launcher() -> bool:
    """True in a rank started by a launcher with more than one process (deepspeed, torchrun, SLURM wrappers)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def quiet_deprecations() -> None:
    """torch deprecates collectives DeepSpeed still calls; every rank would print the same FutureWarning."""
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def init_distributed(timeout_minutes: float | None = None) -> DistEnv:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, nccl on CUDA).

    Without a launcher DeepSpeed would fall into MPI discovery (and fail without mpi4py), so a lone process
    initialises itself as rank 0 of 1 on a free local port. `timeout_minutes` bounds every collective (DeepSpeed's own
    default is 10 minutes, shorter than a large checkpoint save or conversion that other ranks wait for).
    """
    import deepspeed

    quiet_deprecations()

    # A lone process (no launcher): rank 0 of 1 over a TCP rendezvous on a free local port, passed as arguments
    # rather than written into os.environ, where every child process (a tool, a test, a nested job) would inherit
    # RANK/WORLD_SIZE/MASTER_PORT and try to bind this process's port. DeepSpeed's engine reads LOCAL_RANK only.
    lone = "RANK" not in os.environ or "WORLD_SIZE" not in os.environ
    if lone:
        os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        if device.type == "cpu":
            skip_cpu_shm_op_build()
        minutes = DEFAULT_TIMEOUT_MINUTES if timeout_minutes is None else timeout_minutes
        backend = "nccl" if device.type == "cuda" else "gloo"
        if lone:
            deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=minutes),
                                       auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{free_port()}",
                                       rank=0, world_size=1)
        else:
            deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=minutes))
    return DistEnv(
        rank=torch.distributed.get_rank(),
        local_rank=local_rank,
        world_size=torch.distributed.get_world_size(),
        device=device,
    )


def collective_timeout_minutes() -> float | None:
    """The timeout the default process group's backend really holds (None where torch does not expose it)."""
    try:
        from torch.distributed import distributed_c10d

        device = torch.device("cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        backend = distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout.total_seconds() / 60
    except Exception:  # noqa: BLE001 - private torch API; the log then shows the configured value
        return None


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
