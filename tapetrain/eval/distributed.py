"""Rank bookkeeping for the eval tools: one process by default, several under torchrun / the deepspeed launcher."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class EvalRanks:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # we created the process group, so we tear it down

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Sum `values` over ranks (float64; on the model's device so NCCL works)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_eval_ranks() -> EvalRanks:
    """Join the launcher's process group when WORLD_SIZE > 1 (gloo on CPU, nccl on GPU); else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return EvalRanks()
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        owns = True
    if dist.get_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one console voice: rank 0 logs, every rank warns
    return EvalRanks(dist.get_rank(), dist.get_world_size(), owns)
