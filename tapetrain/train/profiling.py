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
    """Call `before_step(step)` and `after_step(step)` around optimizer step `step` (1-based).

    The profiler starts one step before start_step (torch.profiler's warm-up step, not recorded) and records
    `steps` steps as ProfilerStep#N ranges; the trace is written when the last one ends.
    """

    def __init__(self, settings, run_dir: Path, rank: int, device: torch.device):
        self.first = settings.start_step
        self.last = settings.start_step + settings.steps - 1
        self.warmup = 1 if self.first > 1 else 0
        self.snapshot = settings.memory_snapshot and device.type == "cuda"
        self.out = run_dir / PROFILE_DIR
        self.rank = rank
        self.device = device
        self._prof: torch.profiler.profile | None = None
        self._done = False

    def before_step(self, step: int) -> None:
        if step == self.first - self.warmup and self._prof is None and not self._done:
            self._start()

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.step()  # advances the schedule; after the last active step it calls _write
        if step >= self.last:
            self.finish()

    def _start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1, repeat=1)
        self._prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write,
                                            record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.start()
        log.info("profiling steps %d-%d (train.profile)", self.first, self.last)

    def _write(self, prof: torch.profiler.profile) -> None:
        torch.profiler.tensorboard_trace_handler(str(self.out), worker_name=f"rank{self.rank}")(prof)
        written = [str(p) for p in sorted(self.out.glob(f"rank{self.rank}.*.pt.trace.json"))[-1:]]
        if self.snapshot:
            path = self.out / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(str(path))
        self._done = True
        log.info("profile written: %s (open the trace in TensorBoard's profiler tab or ui.perfetto.dev)",
                 ", ".join(written))

    def finish(self) -> None:
        """Stop (also when the run ends or stops inside the profiled steps; a partial trace is still written)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()  # writes the trace through on_trace_ready if the schedule had not finished
        if self.snapshot and not self._done:
            torch.cuda.memory._record_memory_history(enabled=None)
