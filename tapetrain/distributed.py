"""Ranks, process groups and collectives, for training, checkpoints and the eval tools alike.

Works as a single process, under the deepspeed launcher, torchrun or SLURM. Neutral ground: train/, checkpoint/ and
eval/ all use it, and it imports none of them (checkpoint code must not depend on the train package).

    DistEnv, local_device, under_launcher    who and where this process is
    init_distributed                         training: the process group through DeepSpeed, also for a lone process
    EvalRanks, init_eval_ranks               eval tools: the launcher's group when there is one, else none; how
                                             they split work (share) and merge results (gather)
    all_reduce_sum, barrier                  collectives that are no-ops for a lone process
    agree                                    a check that fails on one rank stops every rank, one rank says why
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tapetrain.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DiskSpaceError,
    InputError,
    MissingInputError,
    MissingPackageError,
    RunDirLockedError,
    RunError,
    UserError,
)

DEFAULT_TIMEOUT_MINUTES = 30.0
log = logging.getLogger(__name__)

# ---- who and where this process is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job; the defaults describe a lone CPU process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_launcher() -> bool:
    """True in a rank started by a launcher with more than one process (deepspeed, torchrun, SLURM wrappers)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    """This process's rank on its machine, as the launcher set it (0 for a lone process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_device() -> torch.device:
    """GPU LOCAL_RANK where CUDA is available (launchers start one process per GPU), else the CPU."""
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def reserved_port() -> Iterator[int]:
    """A local port the OS picked, kept bound until the block ends: the socket has SO_REUSEADDR and does not listen,
    so a rendezvous inside the block (TCPStore binds with SO_REUSEADDR) can listen on it, while no other port-0 pick
    on the machine is given it in between (closing the socket before the rendezvous binds would leave that window)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def group_world_size() -> int:
    """Ranks in the default process group; 1 when there is none."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ---- training: the process group through DeepSpeed -----------------------------------------------------------


def skip_cpu_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory collective op.

    Only DeepSpeed's inference all-reduce uses that op (training goes through torch.distributed/gloo), yet its
    backend builds it on every CPU start: a C++ compile per fresh machine, and a build killed half-way leaves a
    lock in the torch extensions folder on which every later start waits forever.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


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
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        if device.type == "cpu":
            skip_cpu_shm_op_build()
        minutes = DEFAULT_TIMEOUT_MINUTES if timeout_minutes is None else timeout_minutes
        backend = "nccl" if device.type == "cuda" else "gloo"
        groups_default_to(timedelta(minutes=minutes))
        if lone:
            with reserved_port() as port:
                deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=minutes),
                                           auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}",
                                           rank=0, world_size=1)
        else:
            with reporting_the_wait():
                deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=minutes))
    return DistEnv(
        rank=torch.distributed.get_rank(),
        local_rank=local_rank(),
        world_size=torch.distributed.get_world_size(),
        device=device,
    )


WAIT_REPORT_S = 60.0  # default of TAPETRAIN_WAIT_REPORT_S


def waiting_message(waited_s: float) -> str:
    """Who this rank waits for while the process group forms: the rendezvous, the rank count and, from a launch
    through launch/multi_node.sh, the hostfile's nodes."""
    env = os.environ
    node = f" (node {env['CROSS_RANK']} of {env['CROSS_SIZE']})" if "CROSS_RANK" in env and "CROSS_SIZE" in env else ""
    nodes = f"; the hostfile's {env['TAPETRAIN_NODES']}" if env.get("TAPETRAIN_NODES") else ""
    return (f"rank {env.get('RANK', '?')}{node} has waited {waited_s:.0f} s at {env.get('MASTER_ADDR', '?')}:"
            f"{env.get('MASTER_PORT', '?')} for all {env.get('WORLD_SIZE', '?')} ranks to join{nodes}; start the "
            "launch on every node (launch/multi_node.sh with each node's NODE_RANK, or over ssh) and check that "
            "every node reaches MASTER_ADDR:MASTER_PORT")


@contextmanager
def reporting_the_wait() -> Iterator[None]:
    """Each node's first rank says every TAPETRAIN_WAIT_REPORT_S seconds (default 60; 0 = never) that it is still
    waiting for the process group: a node that was never started, or cannot reach MASTER_ADDR, otherwise leaves
    the others waiting silently until the collective timeout."""
    every = float(os.environ.get("TAPETRAIN_WAIT_REPORT_S", WAIT_REPORT_S))
    if every <= 0 or local_rank() != 0:
        yield
        return
    done = threading.Event()

    def report() -> None:
        start = time.monotonic()
        while not done.wait(every):
            log.warning(waiting_message(time.monotonic() - start))

    thread = threading.Thread(target=report, name="tapetrain-wait-report", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def groups_default_to(default: timedelta) -> None:
    """Make every process group created without a timeout use `default` (the world group's).

    torch gives such a group its backend's default (30 minutes for gloo, 10 for nccl), not the world group's.
    DeepSpeed creates its groups that way (deepspeed.comm.new_group passes no timeout), among them the clone of
    the world group that carries the ZeRO gradient reductions, so one hung rank blocked the others for 30 minutes
    whatever deepspeed.timeout_minutes said. new_subgroups and friends call new_group inside distributed_c10d,
    so both names are replaced.
    """
    from torch.distributed import distributed_c10d

    original = getattr(distributed_c10d.new_group, "__wrapped__", distributed_c10d.new_group)

    @functools.wraps(original)
    def new_group(ranks=None, timeout=None, *args, **kwargs):
        return original(ranks, default if timeout is None else timeout, *args, **kwargs)

    distributed_c10d.new_group = new_group
    torch.distributed.new_group = new_group


def collective_timeout_minutes() -> float | None:
    """The timeout the default process group's backend really holds (None where torch does not expose it)."""
    try:
        from torch.distributed import distributed_c10d

        device = torch.device("cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        backend = distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout.total_seconds() / 60
    except Exception:  # noqa: BLE001 - private torch API; the log then shows the configured value
        return None


# ---- eval tools: the launcher's group, or none -----------------------------------------------------------------


@dataclass(frozen=True)
class EvalRanks(DistEnv):
    """A DistEnv for the eval tools, which also remembers whether they created the process group."""

    owns_group: bool = False  # we created the process group, so we tear it down
    sequence_parallel: int = 1  # U: Ulysses
    context_parallel: int = 1  # R: the ring; groups of N = R × U consecutive ranks share each work item (T/N tokens)

    # Every eval tool splits its work with `share` and merges results with `gather` (or all_reduce_sum): a layout
    # other than plain data parallelism (sequence-parallel groups that share one work item) changes these only.

    def share(self, count: int) -> list[int]:
        """The indices, out of `count` work items (windows, prompt batches, examples), that this rank evaluates:
        every (world_size / N)-th one from its data-parallel rank (rank // N), the same for a group's N ranks."""
        from tapetrain.rank_layout import ParallelLayout

        layout = ParallelLayout(self.world_size, self.sequence_parallel, self.context_parallel)
        return list(range(layout.data_parallel_rank(self.rank), count, layout.data_parallel))

    def gather(self, local: dict[Any, Any]) -> dict[Any, Any]:
        """{item key: result} of every rank merged, in key order, on every rank (collective). The ranks of a
        sequence-parallel group hold the same results for the same keys."""
        if group_world_size() == 1:
            return dict(sorted(local.items()))
        parts: list[dict | None] = [None] * group_world_size()
        torch.distributed.all_gather_object(parts, local)
        merged: dict[Any, Any] = {}
        for part in parts:
            merged.update(part or {})
        return dict(sorted(merged.items()))

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            # every rank reaches here before any tears down: a peer's gloo threads torn down while another rank
            # still talks to them aborted a rank at exit ("terminate called without an active exception"). Not
            # while an error propagates (close runs in a finally): a failed peer would never arrive.
            if self.world_size > 1 and sys.exc_info()[0] is None:
                torch.distributed.barrier()
            destroy_process_group()


def destroy_process_group() -> None:
    """Tear the default process group down, and DeepSpeed's cached groups with it when DeepSpeed is loaded.

    torch's own destroy left DeepSpeed's clone of the world group (and the SP `mpu`) cached: the next
    deepspeed.initialize in the same process failed with "Group ... is not registered". DeepSpeed 0.19.8's
    deepspeed.comm.destroy_process_group releases those references; it is used whenever DeepSpeed started the group.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    # the live backend is deepspeed.comm.comm.cdb (the package re-exports the None it started with)
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    if deepspeed_comm is not None and getattr(deepspeed_comm, "cdb", None) is not None:
        deepspeed_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def end_rank_process(code: int = 0) -> None:
    """End a per-rank script (one the launcher started) without interpreter shutdown: meet the other ranks, leave
    the process group, flush, then os._exit.

    Even after the group is destroyed, a rank can abort at exit ("terminate called without an active exception",
    SIGABRT, exit -6) once its peer has gone: gloo's threads meet C++ static destruction unjoined. It struck one
    or two of the test suite's multi-rank launches in several full runs, a different script each time, and turns a
    finished job into a failed one. Only for `__main__` of a script whose outputs are written and closed: atexit
    handlers do not run."""
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if code == 0:
                torch.distributed.barrier()
            destroy_process_group()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def init_eval_ranks() -> EvalRanks:
    """Join the launcher's process group when WORLD_SIZE > 1 (gloo on CPU, nccl on GPU); else a single process.

    Plain torch.distributed, no DeepSpeed: an eval tool on one process needs no group at all.
    """
    device = local_device()
    if not under_launcher():
        return EvalRanks(local_rank=local_rank(), device=device)  # no process group
    dist = torch.distributed
    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        owns = True
    if dist.get_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one console voice: rank 0 logs, every rank warns
    return EvalRanks(rank=dist.get_rank(), local_rank=local_rank(), world_size=dist.get_world_size(),
                     device=device, owns_group=owns)


# ---- collectives -----------------------------------------------------------------------------------------------


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum `values` over ranks (float64, on `device` so that NCCL can reduce it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if group_world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---- stopping together -----------------------------------------------------------------------------------------
# Under a launcher a rank that raises alone leaves the others blocked in their next collective until a timeout;
# `agree` turns a failure on one rank into the same exception on all of them, printed once (by the lowest failing
# rank; the copies on the other ranks carry `reported_elsewhere`).

# Failures whose message is the whole story (they name the problem and the fix): no traceback needed.
EXPECTED_ERRORS = (UserError,)
_BY_NAME = {cls.__name__: cls for cls in (ConfigError, DataError, RunError, DiskSpaceError, RunDirLockedError,
                                          CheckpointError, InputError, MissingInputError, MissingPackageError)}


def agree(env: DistEnv, check: Callable[[], None], *, on_main_only: bool = False) -> None:
    """Run `check` on every rank (or on rank 0 only); if it raised an expected error anywhere, raise on all ranks.

    Collective: every rank must call it at the same point.
    """
    error: BaseException | None = None
    if env.is_main or not on_main_only:
        try:
            check()
        except EXPECTED_ERRORS as err:
            error = err
    world = group_world_size()
    if world == 1:
        if error is not None:
            raise error
        return
    payload = None if error is None else (_kind(error), str(error))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, payload)
    failed = [(rank, p) for rank, p in enumerate(gathered) if p is not None]
    if not failed:
        return
    first_rank, (kind, message) = failed[0]
    if error is not None and env.rank == first_rank:
        raise error  # the original, printed by this rank
    copy = _BY_NAME.get(kind, RunError)(f"rank {first_rank}: {message}" if first_rank else message)
    copy.reported_elsewhere = True  # type: ignore[attr-defined]
    raise copy


def _kind(error: BaseException) -> str:
    for cls in type(error).__mro__:
        if cls.__name__ in _BY_NAME:
            return cls.__name__
    return "RunError"
