"""A ZeRO-3 checkpoint resumed on another number of ranks, with its fp32 master weights and Adam moments exact.

DeepSpeed 0.19.8's universal conversion restored ZeRO-3's Adam moments only approximately in our tests, so a
resume on another rank count used to reset them. This module does the re-partitioning itself, from the files
every ZeRO-3 save writes:

* zero_pp_rank_R_mp_rank_00_model_states.pt: `param_shapes`, one {name: shape} per optimizer sub-group, in the
  order the sub-group's flat fp32 partition holds them;
* zero_pp_rank_R_mp_rank_00_optim_states.pt: rank R's flat fp32 partition of every sub-group (`fp32_flat_groups`)
  and the client AdamW's state of each flat partition (`exp_avg`, `exp_avg_sq`, `step`), in the same layout.

ZeRO-3 gives rank R elements [R·k, (R+1)·k) of every parameter's flattened tensor, k = ceil(numel / ranks), zero
padded, and lays a sub-group's parameters one after another in its flat partition. So parameter i of a sub-group
starts at the sum of the k of the parameters before it, on every rank; its full tensor is the concatenation of
those slices over the ranks, cut to numel. The files are memory-mapped: one parameter is gathered at a time.

The new engine's partitions are then written through DeepSpeed's public setters (`safe_set_full_fp32_param`,
`safe_set_full_optimizer_state`), which take each rank's slice of the full tensor in the new partitioning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tapetrain.errors import RunError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

# What is carried per parameter: the fp32 master weights, then Adam's moments (by their torch.optim.AdamW names).
MASTER = "fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Slot:
    """Where a parameter lies in every rank's flat partitions: sub-group, offset, elements per rank, shape."""

    sub_group: int
    offset: int
    per_rank: int
    shape: torch.Size


class SavedZero3:
    """The fp32 weights, Adam moments and Adam step of a ZeRO-3 checkpoint, by parameter name, on demand."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        optim_files = sorted(checkpoint.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
        if not optim_files:
            raise RunError(
                f"{checkpoint} holds no ZeRO optimizer files (*_optim_states.pt): it is not a complete "
                "ZeRO-3 checkpoint. Resume from another checkpoint, or on the rank count it was saved on"
            )
        self.world_size = len(optim_files)
        # per rank, per sub-group: {"fp32": flat, "exp_avg": flat, "exp_avg_sq": flat}
        self.flats = [_flat_partitions(path) for path in optim_files]
        self.step = self._adam_step(optim_files[0])
        shapes = _load(_model_states_file(checkpoint, 0))["param_shapes"]
        self.slots = self._layout(shapes)

    def _adam_step(self, path: Path) -> Any:
        state = _load(path)["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        steps = {float(s["step"]) for s in state.values()}
        if len(steps) != 1:
            raise RunError(f"{path}: the optimizer sub-groups were saved at different Adam steps {sorted(steps)}")
        return next(iter(state.values()))["step"]

    def _layout(self, shapes: list[dict[str, Any]]) -> dict[str, Slot]:
        """Each parameter's slot, checked against the size of every rank's flat partitions."""
        slots = {}
        for sub_group, group_shapes in enumerate(shapes):
            offset = 0
            for name, shape in group_shapes.items():
                per_rank = math.ceil(math.prod(shape) / self.world_size)
                slots[name] = Slot(sub_group, offset, per_rank, torch.Size(shape))
                offset += per_rank
            for rank, flats in enumerate(self.flats):
                if sub_group >= len(flats) or flats[sub_group][MASTER].numel() < offset:
                    raise RunError(
                        f"{self.checkpoint}: rank {rank}'s optimizer file does not hold the parameters "
                        "its model_states file lists (a damaged or mixed checkpoint). Resume from another "
                        "checkpoint, or on the rank count it was saved on"
                    )
        return slots

    def full(self, name: str, key: str) -> torch.Tensor:
        """Parameter `name`'s full tensor of `key` (MASTER or one of MOMENTS), fp32."""
        slot = self.slots[name]
        parts = [flats[slot.sub_group][key].narrow(0, slot.offset, slot.per_rank) for flats in self.flats]
        return torch.cat(parts).narrow(0, 0, slot.shape.numel()).view(slot.shape)


def _rank_of(path: Path) -> int:
    return int(path.name.split("zero_pp_rank_")[1].split("_")[0])


def _model_states_file(checkpoint: Path, rank: int) -> Path:
    found = sorted(checkpoint.glob(f"*zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    if not found:
        raise RunError(
            f"{checkpoint} has no model_states file for rank {rank}: not a complete ZeRO-3 checkpoint. "
            "Resume from another checkpoint"
        )
    return found[0]


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - torch reports a truncated or corrupt file in many ways
        raise RunError(
            f"cannot read {path} ({err}): the checkpoint is damaged. Resume from another checkpoint, "
            "or on the rank count it was saved on"
        ) from err


def _flat_partitions(path: Path) -> list[dict[str, torch.Tensor]]:
    saved = _load(path)["optimizer_state_dict"]
    masters, state = saved["fp32_flat_groups"], saved["optimizer_state_dict"]["state"]
    if len(state) != len(masters) or any(state[i][m].numel() != masters[i].numel() for i in state for m in MOMENTS):
        raise RunError(
            f"{path}: the Adam moments do not match the fp32 partitions (not an AdamW ZeRO-3 "
            "checkpoint of this version). Resume on the rank count it was saved on"
        )
    # the state is keyed by position: sub-group i's flat partition is the i-th tensor of the param groups
    return [{MASTER: masters[i], **{m: state[i][m] for m in MOMENTS}} for i in range(len(masters))]


def load_into(engine: DeepSpeedEngine, saved: SavedZero3) -> None:
    """Set every trainable parameter's fp32 master weights and Adam moments (this rank's slices of the new
    partitioning) and Adam's step, then copy the masters into the model's partitions (its training dtype)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    optimizer = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    _create_adam_state(optimizer, saved.step)
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if name not in saved.slots:
            raise RunError(
                f"{saved.checkpoint} holds no optimizer state for {name}: it was saved with another "
                "trainable set. Resume on the rank count it was saved on"
            )
        safe_set_full_fp32_param(param, saved.full(name, MASTER))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, saved.full(name, key), key)
    with torch.no_grad():
        for masters, model in zip(
            optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat, strict=True
        ):
            if model is not None and masters.numel():  # None: parameters offloaded to NVMe (not used by tapetrain)
                model.copy_(masters)  # the partitions' ds_tensors are views into these flat buffers


def _create_adam_state(optimizer: Any, step: Any) -> None:
    """AdamW creates its state at the first step; DeepSpeed's setters need it now (zero moments, to be set)."""
    for flat in optimizer.fp32_partitioned_groups_flat:
        optimizer.optimizer.state[flat] = {
            "step": step.clone() if torch.is_tensor(step) else torch.tensor(float(step)),
            **{key: torch.zeros_like(flat) for key in MOMENTS},
        }
