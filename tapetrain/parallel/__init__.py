"""Parallelism beyond data parallel: sequence parallelism (DeepSpeed-Ulysses).

    layout.py    ParallelLayout: which ranks share a sequence, which read the same samples (pure arithmetic)
    ulysses.py   the process groups (DeepSpeed's parallel_state_sp, also the engine's mpu), the model's
                 SequenceShard over DeepSpeed's DistributedAttention, and the slicing of batches
"""

from tapetrain.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout"]
