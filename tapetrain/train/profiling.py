"""`train.profile`: torch.profiler over a few optimizer steps, one trace per rank in RUN_DIR/profile/.

The trace (rankN.<time>.pt.trace.json) opens in TensorBoard (`tensorboard --logdir RUN_DIR/profile`, PyTorch
Profiler tab, with torch-tb-profiler installed) and in Perfetto (ui.perfetto.dev) or chrome://tracing. On CUDA,
`memory_snapshot` also records the caching allocator's history over the same steps and dumps it as
rankN_memory_snapshot.pickle, which pytorch.org/memory_viz draws.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("tapetrain.train")

PROFILE_DIR = "profile"


class StepProfiler:
    """Call `before_step(step)` and `after_step(step)` around optimizer step `step` (1-based)."""

    def __init__(self, settings, run_dir: Path, rank: int, device: torch.device):
        self.first = settings.start_step
        self.last = settings.start_step + settings.steps - 1
        self.snapshot = settings.memory_snapshot and device.type == "cuda"
        self.out = run_dir / PROFILE_DIR
        self.rank = rank
        self.device = device
        self._prof: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if step != self.first or self._prof is not None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                            with_stack=False)
        self._prof.start()
        log.info("profiling steps %d-%d (train.profile)", self.first, self.last)

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.step()  # one profiler step per optimizer step: ProfilerStep#N in the trace
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (also when the run ends or stops inside the profiled steps)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        torch.profiler.tensorboard_trace_handler(str(self.out), worker_name=f"rank{self.rank}")(prof)
        written = [str(p) for p in sorted(self.out.glob(f"rank{self.rank}.*.pt.trace.json"))[-1:]]
        if self.snapshot:
            path = self.out / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(str(path))
        log.info("profile written: %s (open the trace in TensorBoard's profiler tab or ui.perfetto.dev)",
                 ", ".join(written))
