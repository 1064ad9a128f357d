"""Sequence parallelism on DeepSpeed-Ulysses (DeepSpeed 0.19.8): groups, the model's shard, slices of batches.

    sp = init_sequence_parallel(layout, env)    # collective: DeepSpeed's parallel_state_sp builds the groups
    model.shard_sequence(sp.shard)              # the model's SequenceShard: DistributedAttention on the group
    deepspeed.initialize(..., mpu=sp.mpu)       # ZeRO and gradient averaging over data × sequence parallel
    inputs, labels = sp.local(inputs, labels)   # this rank's T/N tokens (labels already shifted)

The engine takes parallel_state_sp as its `mpu` (the path ALST's Hugging Face integration uses; EngineMpu adds
the one function it lacks): DeepSpeed then partitions ZeRO state over all ranks (its sequence-data-parallel group),
divides summed gradients by the data-parallel size W/N and reduces them in `seq_parallel_communication_data_type`
(DeepSpeed's default fp32). The shard's attention is `deepspeed.sequence.layer.DistributedAttention` with scatter
index 2 (heads) and gather index 1 (tokens) on token-major (B, T, H, ·) tensors; ALST's UlyssesSPAttentionHF cannot
serve TAPE (it requires keys and values of one shape, and TAPE's values are [V ‖ E], twice as wide).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tapetrain.distributed import DistEnv, skip_cpu_shm_op_build
from tapetrain.errors import RunError
from tapetrain.model.sequence_shard import LocalAttention, local_tokens
from tapetrain.parallel.group_reductions import GroupReductions
from tapetrain.parallel.layout import ParallelLayout, local_ranks_warning

log = logging.getLogger("tapetrain.train")


def _call_given(q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, local_attention: LocalAttention):
    """DistributedAttention's local attention: the function each call passes along."""
    return local_attention(q, k, values)


class UlyssesShard(GroupReductions):
    """The model's SequenceShard (tapetrain.model.sequence_shard) over one sequence-parallel group."""

    def __init__(self, group: Any, rank: int, size: int):
        from deepspeed.sequence.layer import DistributedAttention

        self.group, self.rank, self.size = group, rank, size
        # (B, T/N, H, ·) -> all-to-all over heads (index 2) gathering tokens (index 1) -> (B, T, H/N, ·), and back
        self._exchange = DistributedAttention(_call_given, group, scatter_idx=2, gather_idx=1)

    def attend(self, local_attention: LocalAttention, q: torch.Tensor, k: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        return self._exchange(q, k, values, 0, None, local_attention)  # batch index 0, no rotary inside


class EngineMpu:
    """DeepSpeed's parallel_state_sp as the engine's `mpu`, plus the tensor-parallel world size it lacks (1).

    parallel_state_sp aliases "model parallel" to the sequence-parallel group, which DeepSpeed's gradient-norm paths
    pair consistently (rank and group), so that alias stays. But without get_tensor_model_parallel_world_size,
    DeepSpeed 0.19.8 records the SP degree as the checkpoint's tensor-parallel degree (ds_to_universal then wants N
    model-state files and cannot convert the checkpoint for another rank count), and loading a universal
    checkpoint calls that function outright. There is no tensor parallelism here: 1."""

    def __init__(self, state: ModuleType):
        self._state = state

    def __getattr__(self, name: str) -> Any:  # everything else: parallel_state_sp's own functions
        return getattr(self._state, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


@dataclass
class SequenceParallel:
    """This rank's place in the layout, the groups DeepSpeed built (as the engine's `mpu`) and the model's shard."""

    layout: ParallelLayout
    rank: int
    mpu: EngineMpu  # deepspeed.runtime.sequence_parallel.parallel_state_sp for deepspeed.initialize
    shard: Any  # UlyssesShard, or with parallel.context_parallel > 1 tapetrain.parallel.context.RingShard

    @property
    def size(self) -> int:
        return self.layout.sequence_ranks

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(self.rank)

    def local(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T, ...) -> this rank's tokens (B, T/N, ...) of each (a contiguous slice; with a ring, its part of two
        opposite chunks); labels must be shifted before."""
        return tuple(x[:, local_tokens(self.shard, x.shape[1])].contiguous() for x in tensors)


def ranks_per_node() -> int | None:
    """Processes per node as the launcher says (torchrun LOCAL_WORLD_SIZE, deepspeed LOCAL_SIZE), else the GPUs."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def init_sequence_parallel(layout: ParallelLayout, env: DistEnv) -> SequenceParallel | None:
    """The groups of `layout` (collective: every rank calls it), or None without sequence parallelism. Needs the
    process group (training's init_distributed, or the eval tools' init_eval_ranks).

    DeepSpeed keeps the groups in module state, so a second start in the same process reuses them (same N)."""
    n = layout.sequence_ranks  # DeepSpeed's groups: every rank that shares a sequence (ring × Ulysses)
    if n == 1:
        return None
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if not deepspeed.comm.is_initialized():  # a process group made without DeepSpeed (the eval tools'): adopt it
        if env.device.type == "cpu":
            skip_cpu_shm_op_build()
        deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)

    warning = local_ranks_warning(layout.sequence_parallel, ranks_per_node())
    if warning and env.is_main:
        log.warning("%s", warning)
    try:
        existing = mpu.get_sequence_parallel_world_size()
    except AssertionError:  # not built yet
        mpu.initialize_sequence_parallel(n)
        existing = n
    if existing != n:
        setting = (f"parallel.sequence_parallel={n}" if layout.context_parallel == 1 else
                   f"parallel.context_parallel={layout.context_parallel} × parallel.sequence_parallel="
                   f"{layout.sequence_parallel}")
        raise RunError(f"this process already has sequence-parallel groups of {existing} ranks; start a new "
                       f"process for {setting}")
    if layout.context_parallel > 1:
        from tapetrain.parallel.context import init_ring_shard

        shard = init_ring_shard(layout, env.rank, mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank())
    else:
        shard = UlyssesShard(mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), n)
    if shard.rank != layout.sequence_rank(env.rank):  # DeepSpeed's groups must be the layout we describe
        raise RunError(f"rank {env.rank} is rank {shard.rank} of its sequence-parallel group, expected "
                       f"{layout.sequence_rank(env.rank)} (groups of {n} consecutive ranks)")
    return SequenceParallel(layout, env.rank, EngineMpu(mpu), shard)
