"""The training loop: a short orchestration of stateful components (engine, data, checkpoints, metrics)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch

from tapetrain.checkpoint import store
from tapetrain.data.supervised import inputs_and_labels
from tapetrain.train.distributed import DistEnv, all_reduce_sum, barrier
from tapetrain.train.metrics import MetricsLogger, device_peak_flops, memory_gb

log = logging.getLogger("tapetrain.train")


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    """Runs optimizer steps until train.steps, saving, validating and logging on the way.

    `components` is what `tapetrain.train.build.build_components` returns: the DeepSpeed engine, the model config,
    the train/val batch iterators and the resume state.
    """

    def __init__(self, cfg, env: DistEnv, components):
        self.cfg = cfg
        self.env = env
        self.c = components
        self.engine = components.engine
        self.run_dir = Path(cfg.run.out_dir)
        self.step = components.start_step
        self.tokens = components.start_tokens
        self.stop_signal: int | None = None
        self.nan_skips_in_a_row = 0
        self.flops_per_token = components.model.flops_per_token(cfg.data.seq_len)
        self.peak_flops = device_peak_flops(env.device, getattr(cfg.train, "peak_tflops", None))
        self.metrics = (
            MetricsLogger(self.run_dir, cfg.train.steps, cfg.logging.tensorboard, self.step) if env.is_main else None
        )

    # ---- signals -------------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            log.warning("received %s: will save a checkpoint after this step and exit", signal.Signals(signum).name)
            self.stop_signal = signum

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _stop_requested(self) -> bool:
        flag = 1.0 if self.stop_signal is not None else 0.0
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

    def _zero_loss(self) -> torch.Tensor:
        """A loss whose gradient is exactly zero for every trainable parameter: backpropagated in place of a
        non-finite micro-batch loss so DeepSpeed's accumulation and reduction stay in step across ranks."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return sum(p.sum() * 0.0 for p in params)

    def train_step(self) -> dict:
        engine, batches = self.engine, self.c.train_batches
        offset = self._position_offset()
        loss_sum, good_micro, data_wait = 0.0, 0, 0.0
        skipped = False
        for micro in range(batches.grad_accum_steps):
            wait_start = time.perf_counter()
            batch = batches.next_micro_batch().to(self.env.device, non_blocking=True)  # (b, seq_len + 1)
            data_wait += time.perf_counter() - wait_start
            inputs, labels = inputs_and_labels(batch)  # supervised examples: labels -100 outside the answers
            out = engine(inputs, labels=labels, position_offset=offset)
            loss = out.loss
            finite = all_reduce_sum([float(torch.isfinite(loss.detach()))], self.env.device)[0] == self.env.world_size
            if not finite:
                skipped = True
                message = (
                    f"non-finite loss at step {self.step + 1} (micro-step {micro}): the model diverged or the batch "
                    "is bad. Lower optim.lr, keep train.grad_clip on, or set train.on_nan=skip to skip such batches; "
                    f"resume from the last good checkpoint in {self.run_dir / store.CHECKPOINTS}"
                )
                if self.cfg.train.on_nan == "stop":
                    raise NonFiniteLossError(message)
                log.warning("%s -- skipping this micro-batch", message.split(". Lower")[0])
                loss = self._zero_loss()
            else:
                loss_sum += float(loss.detach())
                good_micro += 1
            engine.backward(loss)
            engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        if skipped:
            self.nan_skips_in_a_row += 1
            if self.nan_skips_in_a_row > self.cfg.train.max_nan_skips:
                raise NonFiniteLossError(
                    f"{self.nan_skips_in_a_row} steps in a row had non-finite losses (train.max_nan_skips="
                    f"{self.cfg.train.max_nan_skips}): the run has diverged; lower optim.lr and resume from the last "
                    "good checkpoint"
                )
        else:
            self.nan_skips_in_a_row = 0
        total_loss, total_micro = all_reduce_sum([loss_sum, float(good_micro)], self.env.device)
        grad_norm = engine.get_global_grad_norm()
        return {
            "loss": total_loss / total_micro if total_micro else math.nan,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "data_wait_s": data_wait,
            "skipped_micro_batches": batches.grad_accum_steps - good_micro,
        }

    # ---- validation ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict:
        batches = self.c.make_val_batches()
        self.engine.eval()
        nll, count = 0.0, 0.0
        for _ in range(self.cfg.train.eval_steps):
            inputs, labels = inputs_and_labels(batches.next_micro_batch().to(self.env.device))
            out = self.engine(inputs, labels=labels)
            scored = int((labels != -100).sum())
            nll += float(out.loss) * scored if scored else 0.0
            count += scored
        self.engine.train()
        nll, count = all_reduce_sum([nll, count], self.env.device)
        val_loss = nll / count
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # ---- checkpoints -----------------------------------------------------------------------------------------------

    def save(self) -> None:
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "data": self.c.train_batches.state_dict(),
            "world_size": self.env.world_size,
            "zero_stage": self.cfg.deepspeed.zero_stage,
            "seed": self.cfg.run.seed,
        }
        store.save_checkpoint(
            self.engine,
            self.run_dir,
            self.step,
            state,
            self.c.model_config.to_dict(),
            self.env,
            self.cfg.train.keep_last,
        )

    # ---- the loop --------------------------------------------------------------------------------------------------

    def fit(self) -> int:
        cfg = self.cfg
        self._install_signal_handlers()
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        window_start, window_tokens = time.perf_counter(), 0
        last_saved = self.step
        if self.step >= cfg.train.steps:
            log.info("run already complete at step %d (train.steps=%d)", self.step, cfg.train.steps)
        while self.step < cfg.train.steps:
            step_start = time.perf_counter()
            result = self.train_step()
            self.step += 1
            self.tokens += tokens_per_step
            window_tokens += tokens_per_step
            if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_tokens / elapsed
                record = {
                    "step": self.step,
                    "loss": result["loss"],
                    "lr": self.engine.get_lr()[0],
                    "grad_norm": result["grad_norm"],
                    "tokens": self.tokens,
                    "tokens_per_s": tokens_per_s,
                    "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.env.world_size),
                    "mem_gb": memory_gb(self.env.device),
                    "step_time_s": time.perf_counter() - step_start,
                    "data_wait_s": result["data_wait_s"],
                    "skipped_micro_batches": result["skipped_micro_batches"],
                }
                if self.metrics:
                    self.metrics.log(_json_safe(record))
                window_start, window_tokens = time.perf_counter(), 0
            if self.c.has_val and cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
                val = self.validate()
                if self.metrics:
                    self.metrics.log({"step": self.step, **val})
            stop = self._stop_requested()
            if stop or self.step % cfg.train.save_interval == 0 or self.step == cfg.train.steps:
                self.save()
                last_saved = self.step
            if stop:
                log.warning(
                    "stopped by signal at step %d; checkpoint saved. Resume with the same command (train.resume=auto)",
                    self.step,
                )
                break
        if last_saved != self.step:
            self.save()
        if self.metrics:
            self.metrics.close()
        barrier()
        if self.env.is_main and self.step >= cfg.train.steps:
            done = {"step": self.step, "tokens": self.tokens, "finished": True}
            tmp = self.run_dir / "DONE.json.tmp"
            tmp.write_text(json.dumps(done))
            os.replace(tmp, self.run_dir / "DONE.json")
        return 0


def _json_safe(record: dict) -> dict:
    """NaN/inf are not JSON: write them as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
