"""The training loop: a short orchestration of stateful components (engine, data, checkpoints, metrics)."""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tapetrain import atomic_io
from tapetrain.checkpoint import store
from tapetrain.data.batches import read_batch
from tapetrain.data.cache import remote_data_metrics
from tapetrain.data.supervised import document_ids, inputs_and_labels
from tapetrain.distributed import DistEnv, all_reduce_sum, barrier
from tapetrain.errors import RunError
from tapetrain.model.abacus import abacus_offsets
from tapetrain.train.checkpointing import TrainingProgress
from tapetrain.train.heartbeat import (
    Heartbeat,
    Launcher,
    LauncherWatch,
    failed_collective_error,
    stopped_message,
)
from tapetrain.train.metrics import MetricsLogger, device_peak_flops, memory_gb
from tapetrain.train.schedule import set_schedule_position
from tapetrain.train.step_guard import StepGuard, weights_are_finite

if TYPE_CHECKING:
    from tapetrain.config import RunConfig
    from tapetrain.train.build import Components

log = logging.getLogger("tapetrain.train")

# A run stopping on an error gives its last save this long to finish hashing (every rank's thread works alone).
ABANDON_SAVE_WAIT_S = 120.0


class NonFiniteLossError(RunError):
    """A non-finite loss or gradient under train.on_nan=stop, too many skipped steps, or non-finite weights."""


class Trainer:
    """Runs optimizer steps until train.steps, saving, validating and logging on the way.

    `components` is what `tapetrain.train.build.build_components` returns: the DeepSpeed engine, the model config,
    the train/val batch iterators, where this start continues and the checkpoint manager that saves.
    `launchers`: the processes that launched this rank (heartbeat.supervising_launchers(), recorded at start-up);
    when one has ended, the run stops as on SIGTERM.
    """

    def __init__(self, cfg: RunConfig, env: DistEnv, components: Components, launchers: list[Launcher] | None = None):
        self.cfg = cfg
        self.env = env
        self.c = components
        self.engine = components.engine
        self.sp = components.sequence_parallel  # None, or this rank's slice of every sequence
        self.run_dir = Path(cfg.run.out_dir)
        self.step = components.start.step
        self.tokens = components.start.tokens
        self.stop_reason: str | None = None  # set by a signal or a launcher's end: stop after this step
        self.launchers = launchers or []
        self.born, self.first_step = time.perf_counter(), self.step
        self.nan_skips_in_a_row = 0
        self.skipped_steps = components.start.skipped_steps
        self.guard = StepGuard(self.engine)
        self.flops_per_token = components.model.flops_per_token(cfg.data.seq_len)
        self.peak_flops = device_peak_flops(env.device, cfg.logging.peak_tflops)
        self.run_name = cfg.run.name or self.run_dir.resolve().name
        self.epoch = components.train_batches.epoch
        self.metrics = (
            MetricsLogger(self.run_dir, cfg.train.steps, cfg.logging.tensorboard, self.step, name=self.run_name,
                          mirror=self._wandb_mirror())
            if env.is_main
            else None
        )
        self.profiler = None
        if cfg.train.profile is not None:
            from tapetrain.train.profiling import StepProfiler

            self.profiler = StepProfiler(cfg.train.profile, self.run_dir, env.rank, env.device)

    def _wandb_mirror(self):
        if self.cfg.logging.wandb is None:
            return None
        from tapetrain.train.wandb_mirror import WandbMirror

        return WandbMirror(self.cfg.logging.wandb, self.run_dir, self.run_name, self.cfg.to_dict())

    # ---- signals -------------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            name = signal.Signals(signum).name
            log.warning("received %s: will save a checkpoint after this step and exit", name)
            self.stop_reason = self.stop_reason or f"by signal {name}"

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _launcher_gone(self, launcher: Launcher) -> None:
        """From the launcher watch's thread: nothing would stop this rank any more, so stop as on SIGTERM."""
        if self.env.local_rank == 0:  # every rank of this node sees it: one says so
            log.warning("%s. Saving a checkpoint after this step and exiting", launcher.gone_notice())
        self.stop_reason = self.stop_reason or "by its launcher's end"

    def _stop_requested(self) -> bool:
        flag = 1.0 if self.stop_reason is not None else 0.0
        return all_reduce_sum([flag], self.env.device)[0] > 0  # every rank stops at the same step

    # ---- one optimizer step ----------------------------------------------------------------------------------------

    def _position_offset(self) -> int:
        """A random global position offset per step (TAPE/RoPE are shift-invariant; this only varies rounding).
        Drawn from (seed, step) so it is identical on every rank and after a resume."""
        limit = self.cfg.train.random_position_offset
        if not limit:
            return 0
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + self.step)
        return int(torch.randint(0, limit + 1, (1,), generator=gen))

    def _abacus_offsets(self, slots) -> dict:
        """model.abacus: the forward's abacus_offsets keyword, a pure function of (run.seed, the samples' global
        slots), so the same on any number of ranks and after a resume (model/abacus.py); {} without Abacus."""
        model_cfg = self.c.model.cfg
        if not model_cfg.abacus:
            return {}
        offsets = abacus_offsets(self.cfg.run.seed, slots, model_cfg.abacus_train_offset)
        return {"abacus_offsets": offsets.to(self.env.device)}

    def train_step(self) -> dict:
        """One optimizer step. The loss sum and the count of finite micro-batch losses stay on the device and are
        reduced once, before the boundary engine.step(): a non-finite loss on any rank skips the whole update
        (StepGuard), as does a non-finite gradient norm (DeepSpeed, or StepGuard on ZeRO-0)."""
        engine, batches = self.engine, self.c.train_batches
        offset = self._position_offset()
        lr = engine.get_lr()[0]  # the LR of this step's update (the scheduler moves on inside engine.step())
        device = self.env.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        finite_count = torch.zeros((), dtype=torch.float64, device=device)
        data_wait = 0.0
        accum = batches.grad_accum_steps
        for micro in range(accum):
            wait_start = time.perf_counter()
            abacus = self._abacus_offsets(batches.slots_ahead(0))  # before next_micro_batch moves past them
            batch = batches.next_micro_batch().to(device, non_blocking=True)  # (b, seq_len + 1)
            data_wait += time.perf_counter() - wait_start
            inputs, labels = inputs_and_labels(batch)  # supervised examples: labels -100 outside the answers
            docs = document_ids(batch)  # (b, seq_len) int32 with data.document_mask, else None
            if self.sp is not None:  # this rank's T/N tokens; the loss is the group's (every rank logs the same)
                inputs, labels = self.sp.local(inputs, labels)  # document ids stay whole (the model slices them)
            out = engine(inputs, labels=labels, position_offset=offset, **_documents(docs), **abacus)
            loss = out.loss.detach()
            finite = torch.isfinite(loss)
            loss_sum += torch.where(finite, loss, torch.zeros_like(loss)).double()
            finite_count += finite.double()
            engine.backward(out.loss)  # a NaN loss gives NaN gradients: the step below is skipped either way
            if micro < accum - 1:
                engine.step()  # not a boundary: DeepSpeed only advances its micro-step counters
        totals = torch.stack([loss_sum, finite_count])  # (2,)
        if self.env.world_size > 1:
            torch.distributed.all_reduce(totals)
        total_loss, total_finite = totals.tolist()  # the one host read per optimizer step
        bad_loss = total_finite < accum * self.env.world_size
        self.guard.begin_step(skip=bad_loss)
        overflows_before = engine.skipped_steps
        engine.step()  # the boundary: DeepSpeed applies the update unless its gradient norm is non-finite
        skipped = self.guard.skipped or engine.skipped_steps > overflows_before
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        if skipped:
            self._handle_skipped_step(bad_loss, grad_norm)
        else:
            self.nan_skips_in_a_row = 0
        return {
            "loss": total_loss / total_finite if total_finite else math.nan,
            "lr": lr,
            "grad_norm": grad_norm,
            "data_wait_s": data_wait,
            "skipped_steps": self.skipped_steps,
        }

    def _handle_skipped_step(self, bad_loss: bool, grad_norm: float) -> None:
        """Apply train.on_nan to a step whose update was not applied (weights and optimizer state unchanged)."""
        step = self.step + 1
        set_schedule_position(self.engine, self.c.scheduler, self.cfg.optim, self.cfg.train.steps, step)
        d = self.cfg.deepspeed
        if not bad_loss and d.precision == "fp16" and d.loss_scale == 0:
            log.info("step %d: fp16 gradient overflow, DeepSpeed lowered the loss scale and skipped the update", step)
            return
        what = "non-finite loss" if bad_loss else f"non-finite gradient norm ({grad_norm}) with a finite loss"
        if self.cfg.train.on_nan == "stop":
            raise NonFiniteLossError(
                f"{what} at step {step}: the model diverged or the batch is bad; the update was not applied. "
                f"Lower optim.lr (a resume applies the new value from the resumed step), keep train.grad_clip on, or "
                "set train.on_nan=skip to skip such steps; then resume from the last good checkpoint in "
                f"{self.run_dir / store.CHECKPOINTS} (same command, train.resume=auto)",
                reported_elsewhere=not self.env.is_main,  # every rank stops at this step; rank 0 says why
            )
        self.nan_skips_in_a_row += 1
        self.skipped_steps += 1
        log.warning("step %d skipped (%s): weights and optimizer state unchanged (%d in a row, train.max_nan_skips=%d)",
                    step, what, self.nan_skips_in_a_row, self.cfg.train.max_nan_skips)
        if self.nan_skips_in_a_row > self.cfg.train.max_nan_skips:
            raise NonFiniteLossError(
                f"{self.nan_skips_in_a_row} steps in a row were skipped for non-finite losses or gradients (last: step "
                f"{step}; train.max_nan_skips={self.cfg.train.max_nan_skips}): the run has diverged. Lower optim.lr "
                f"and resume from the last good checkpoint in {self.run_dir / store.CHECKPOINTS}",
                reported_elsewhere=not self.env.is_main,
            )

    def _check_weights(self, when: str) -> None:
        """Collective: stop (no checkpoint, no DONE.json) if any rank holds a non-finite weight."""
        bad = 0.0 if weights_are_finite(self.engine.module) else 1.0
        if all_reduce_sum([bad], self.env.device)[0] > 0:
            raise NonFiniteLossError(
                f"the weights contain NaN/inf {when} (step {self.step}); nothing was saved and DONE.json is not "
                f"written. Resume from the last good checkpoint in {self.run_dir / store.CHECKPOINTS} with a lower "
                "optim.lr",
                reported_elsewhere=not self.env.is_main,
            )

    # ---- validation ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _log_documents(self) -> None:
        """data.document_mask: mean tokens per document and the attention tiles the mask skips, from the next
        micro batch (read without advancing)."""
        batches = self.c.train_batches
        if not getattr(batches.dataset, "document_mask", False) or not self.env.is_main:
            return
        from tapetrain.data.documents import document_stats

        docs = document_ids(batches.read(batches.micro_batch_indices()))
        if docs is None:
            return
        per_doc, skipped = document_stats(docs)
        log.info("data.document_mask: %.1f tokens per document in the first micro batch; the mask skips %.1f%% of "
                 "the causal 128x128 attention tiles (what block-sparse attention skips)", per_doc, 100 * skipped)

    @torch.no_grad()  # no autograd graph: validation never calls backward, and a graph costs activation memory
    def validate(self) -> dict:
        """Token-weighted mean loss over the same validation samples on any number of ranks (train/validation)."""
        from tapetrain.progress import progress as progress_bar
        from tapetrain.train.validation import eval_sample_count, rank_val_batches

        dataset = self.c.val_dataset
        samples = eval_sample_count(dataset.num_samples, self.cfg.train.eval_steps, self.cfg.train.global_batch_size)
        sp = self.sp
        rank, ranks = (sp.data_parallel_rank, sp.layout.data_parallel) if sp else (self.env.rank, self.env.world_size)
        batches = rank_val_batches(samples, self.cfg.train.micro_batch_size, rank, ranks)
        started = time.perf_counter()
        self.engine.eval()
        nll, count = 0.0, 0.0
        bar = progress_bar(batches, desc=f"validation @ step {self.step}", unit="batch", disable=not self.env.is_main)
        for indices, weight in bar:
            batch = read_batch(dataset, indices).to(self.env.device)
            inputs, labels = inputs_and_labels(batch)
            scored = int((labels != -100).sum())  # of the whole sequences
            if sp is not None:  # every rank of the group scores the same sequences: count them once
                inputs, labels = sp.local(inputs, labels)
                weight /= sp.size
            # mean loss over the scored (label != -100) tokens
            out = self.engine(inputs, labels=labels, **_documents(document_ids(batch)))
            nll += weight * float(out.loss) * scored if scored else 0.0
            count += weight * scored
        self.engine.train()
        nll, count = all_reduce_sum([nll, count], self.env.device)
        val_loss = nll / count
        val_ppl = math.exp(min(val_loss, 50.0))
        log.info("step %d | val_loss %.4f | val_ppl %.4g | %d samples (%d tokens) in %.1f s", self.step, val_loss,
                 val_ppl, samples, int(count), time.perf_counter() - started)
        return {"val_loss": val_loss, "val_ppl": val_ppl}

    # ---- checkpoints -----------------------------------------------------------------------------------------------

    def save(self) -> None:
        self._check_weights("before saving")
        progress = TrainingProgress(self.step, self.tokens, self.skipped_steps)
        self.c.checkpoints.save(self.engine, self.c.train_batches, progress)

    # ---- the loop --------------------------------------------------------------------------------------------------

    def fit(self) -> int:
        cfg = self.cfg
        self._install_signal_handlers()
        if self.step >= cfg.train.steps:
            log.info("run already complete at step %d (train.steps=%d)", self.step, cfg.train.steps)
        # Several ranks: a heartbeat per rank, so that a collective that times out can say who did not arrive.
        heartbeat = Heartbeat(self.run_dir, self.env.rank, self.step + 1) if self.env.world_size > 1 else None
        watch = LauncherWatch(self.launchers, self._launcher_gone).start() if self.launchers else None
        try:
            last_saved = self._train_steps(heartbeat.start() if heartbeat else None)
            self._finish(last_saved)
        except BaseException as err:
            self.c.checkpoints.abandon_save(ABANDON_SAVE_WAIT_S)
            # a collective that failed for a peer (dead, lost, hung) names it; anything else is raised as it is
            step = heartbeat.step if heartbeat is not None else self.step + 1
            peer_error = failed_collective_error(err, self.run_dir, self.env.world_size, self.env.rank, step,
                                                 self.cfg.deepspeed.timeout_minutes)
            if peer_error is not None:
                raise peer_error from err
            raise
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            if watch is not None:
                watch.stop()
        return 0

    def _finish(self, last_saved: int) -> None:
        """The last checkpoint (unless just saved), a final weight check and DONE.json."""
        cfg = self.cfg
        if self.profiler:
            self.profiler.finish()  # the run ended inside the profiled steps
        if last_saved != self.step:
            self.save()
        self.c.checkpoints.wait_for_save()  # DONE.json only once the last checkpoint is complete
        self._check_weights("at the end of the run")
        if self.metrics:
            self.metrics.close()
        close = getattr(self.c.train_batches, "close", None)
        if close is not None:
            close()
        barrier()
        if self.env.is_main and self.step >= cfg.train.steps:
            done = {"step": self.step, "tokens": self.tokens, "finished": True, "name": self.run_name,
                    "skipped_steps": self.skipped_steps}
            atomic_io.write_json(self.run_dir / "DONE.json", done, indent=None, newline=False)
            log.info("done: %s, %s; next: tapetrain export hf %s --out %s-hf", self.run_dir, self._work_done(),
                     self.run_dir, self.run_dir)

    def _train_steps(self, heartbeat: Heartbeat | None) -> int:
        """Optimizer steps until train.steps or a stop signal, logging, validating and saving on the way; returns
        the last step saved."""
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        window_start, window_tokens = time.perf_counter(), 0
        last_saved = self.step
        log_every = cfg.train.log_interval
        show_every = cfg.logging.console_interval or log_every
        save_every = cfg.train.save_interval  # 0 = only the last step (and on a stop signal)
        self._log_documents()
        first_step = self.c.startup if self.step < cfg.train.steps else None
        if first_step is not None:
            first_step.begin("first step", f"step {self.step + 1} (the first steps are slower: warm-up"
                             + (", compilation)" if cfg.model.compile else ")"))
        while self.step < cfg.train.steps:
            if heartbeat is not None:
                heartbeat.step = self.step + 1
            step_start = time.perf_counter()
            if self.profiler:
                self.profiler.before_step(self.step + 1)
            result = self.train_step()
            if self.profiler:
                self.profiler.after_step(self.step + 1)
            if first_step is not None:
                first_step.done("first step", f"step {self.step + 1} done, loss {result['loss']:.4f}")
                first_step = None
            self.step += 1
            self.tokens += tokens_per_step
            window_tokens += tokens_per_step
            self._note_epoch()
            last = self.step == cfg.train.steps
            write, show = self.step % log_every == 0 or last, self.step % show_every == 0 or last
            if write or show:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_tokens / elapsed
                record = {
                    "step": self.step,
                    "loss": result["loss"],
                    "lr": result["lr"],
                    "grad_norm": result["grad_norm"],
                    "tokens": self.tokens,
                    "tokens_per_s": tokens_per_s,
                    "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.env.world_size),
                    "mem_gb": memory_gb(self.env.device),
                    "step_time_s": time.perf_counter() - step_start,
                    "data_wait_s": result["data_wait_s"],
                    "skipped_steps": result["skipped_steps"],
                    **remote_data_metrics(),
                }
                if self.metrics:
                    self.metrics.log(_json_safe(record), write=write, show=show)
                window_start, window_tokens = time.perf_counter(), 0
            if self.c.has_val and cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
                val = self.validate()
                if self.metrics:
                    self.metrics.log({"step": self.step, **val}, show=False)  # validate() printed it
            stop = self._stop_requested()
            if stop or (save_every and self.step % save_every == 0) or last:
                self.save()
                last_saved = self.step
            if stop:
                if self.env.is_main:
                    log.warning("%s", stopped_message(self.step, self.stop_reason, self.run_dir))
                break
        return last_saved

    def _work_done(self) -> str:
        """`50 steps in 1m23s` (from the process start), or `steps 26..50 in 41s` after a resume."""
        from tapetrain.progress import format_duration
        from tapetrain.train.startup import since_process_start

        first = self.first_step
        steps = f"{self.step} steps" if first == 0 else f"steps {first + 1}..{self.step}"
        seconds = since_process_start()
        return f"{steps} in {format_duration(seconds if seconds is not None else time.perf_counter() - self.born)}"

    def _note_epoch(self) -> None:
        epoch = self.c.train_batches.epoch
        if epoch > self.epoch:
            log.warning("data: all %d training samples have been drawn by step %d; epoch %d begins (the same "
                        "samples in a new order)", self.c.train_batches.num_samples, self.step, epoch)
            self.epoch = epoch


def _documents(doc_ids: torch.Tensor | None) -> dict:
    """The model's doc_ids keyword, only when there are ids (runs without the mask call the model as before)."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}


def _json_safe(record: dict) -> dict:
    """NaN/inf are not JSON: write them as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
