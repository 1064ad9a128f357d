"""Skippable optimizer steps: a step with a non-finite loss or gradient changes neither weights nor optimizer state.

DeepSpeed already refuses to apply an update whose global gradient norm is inf/NaN wherever it wraps the optimizer
(ZeRO-1/2/3, the bf16 and fp16 optimizers): it computes that norm, finds it invalid, zeroes the gradients and
skips the step and the LR scheduler ("overflow"). Two cases are left, and this guard closes them by wrapping the
client AdamW's `step` (the base optimizer every DeepSpeed path ends in):

* ZeRO-0 in fp32, where DeepSpeed calls AdamW directly: the guard computes the global gradient norm itself (every
  rank holds the same averaged gradients), reports it as DeepSpeed's `_global_grad_norm`, and sets the
  `overflow` flag DeepSpeed reads, so the engine skips exactly as above. DeepSpeed clips these gradients before
  it calls AdamW, so the norm is measured just before its clipping (the logged grad_norm is the pre-clip norm,
  as DeepSpeed's wrappers report it on every other path).
* A non-finite loss whose gradients came out finite: the trainer reduces one finiteness flag per optimizer step
  (together with the loss sum) before the boundary `engine.step()`, and a raised `skip_requested` makes the base
  step return without touching the fp32 master weights or Adam's moments (the ZeRO wrapper then copies the
  unchanged masters back into the model: the weights stay bit-identical).

Cost: one extra norm pass and one host read per optimizer step, on ZeRO-0 fp32 only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class StepGuard:
    def __init__(self, engine: DeepSpeedEngine):
        self.optimizer = engine.basic_optimizer  # the client AdamW, wrapped or not
        self.checks_gradients = engine.optimizer is self.optimizer  # nothing of DeepSpeed's checks them
        self.skip_requested = False
        self.skipped = False  # set when this guard (not DeepSpeed) skipped the last step
        self._step = self.optimizer.step

        def step(*args, **kwargs):
            return self._guarded_step(*args, **kwargs)

        # The LR scheduler marks the step it tracks; ours still calls that one, so keep the mark (no warning).
        step._wrapped_by_lr_sched = getattr(self._step, "_wrapped_by_lr_sched", False)  # type: ignore[attr-defined]
        self.optimizer.step = step  # an instance attribute: type(optimizer) stays AdamW, as ZeRO requires
        self._pre_clip_norm: torch.Tensor | None = None
        if self.checks_gradients:
            self.optimizer.overflow = False
            self.optimizer._global_grad_norm = None
            self._measure_before_clipping(engine)

    def _measure_before_clipping(self, engine: DeepSpeedEngine) -> None:
        """Measure the norm before DeepSpeed's clip_fp32_gradients (called only when train.grad_clip > 0)."""
        clip = engine.clip_fp32_gradients

        def measure_then_clip():
            self._pre_clip_norm = self._global_grad_norm()
            return clip()

        engine.clip_fp32_gradients = measure_then_clip

    def _global_grad_norm(self) -> torch.Tensor:
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norms = torch._foreach_norm(grads, 2.0)  # one norm per tensor, fp32
        return torch.linalg.vector_norm(torch.stack([n.double() for n in norms]))

    def _guarded_step(self, *args, **kwargs):
        skip = self.skip_requested
        if self.checks_gradients:
            norm = self._pre_clip_norm if self._pre_clip_norm is not None else self._global_grad_norm()
            self._pre_clip_norm = None
            self.optimizer._global_grad_norm = norm
            finite = bool(torch.isfinite(norm))  # the one host read per optimizer step
            self.optimizer.overflow = skip or not finite
            skip = self.optimizer.overflow
        if skip:
            self.skipped = True
            return None
        return self._step(*args, **kwargs)

    def begin_step(self, skip: bool) -> None:
        """Before the boundary engine.step(): whether to skip the update whatever the gradients look like."""
        self.skip_requested = skip
        self.skipped = False


def weights_are_finite(module: torch.nn.Module) -> bool:
    """Whether this rank's parameters (its ZeRO-3 partitions where parameters are partitioned) are all finite;
    one host read."""
    flags = []
    for param in module.parameters():
        data = getattr(param, "ds_tensor", None)
        data = param.data if data is None else data
        if data.numel():
            flags.append(torch.isfinite(data).all())
    return bool(torch.stack(flags).all()) if flags else True
