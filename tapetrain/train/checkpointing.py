"""A run's checkpoints behind one object: which checkpoint a start resumes from and whether it may (check), its
state put back into the model, engine, LR schedule and data order (restore), and writing one (save).

A start calls it in this order (tapetrain.train.build.build_components); every call is collective:

    checkpoints = CheckpointManager(cfg, env, model_config)
    checkpoints.check()                               # before anything is written: the newest intact checkpoint
    checkpoints.check_training_setup(tokenizer_sha)   # (manifest), its model, trainable set, LoRA and tokenizer
    ds_config = checkpoints.prepare(model, ds_config, total_params=..., trainable_params=...)
    engine = deepspeed.initialize(..., config=ds_config)
    start = checkpoints.restore(engine, scheduler, batches)   # loads, then writes the run's files
    ...
    checkpoints.save(engine, batches, progress)       # the Trainer, every train.save_interval steps
    checkpoints.wait_for_save()                       # the end of the run: the last checkpoint is complete

Resuming on another number of ranks: ZeRO partitions are tied to the number of ranks (also with sequence
parallelism: DeepSpeed partitions over all ranks, so parallel.sequence_parallel is an execution setting that any
resume may change). ZeRO-1/2 go through DeepSpeed's universal format, which re-partitions weights and Adam moments
(verified exact in tests/distributed). For ZeRO-3, DeepSpeed 0.19.8's conversion restored the moments only
approximately in our tests, so tapetrain.checkpoint.zero3_reshard re-partitions the saved fp32 masters and moments
itself (also exact, tested).

A run directory changes only once the checkpoint has loaded on every rank: a start that fails while loading
leaves config.yaml, config_history/ and every checkpoint as they were.

Damaged checkpoints: every checkpoint carries a manifest (sizes and checksums, tapetrain.checkpoint.manifest),
verified before a resume trusts it. train.resume=auto takes the newest complete and intact one; it skips a
damaged or incomplete newer one only with train.resume_fallback (saying which and why), and never silently.

The directory format (atomic saves, the newest complete checkpoint, keep-last-K, RNG files) is
tapetrain.checkpoint.store's; what a resume may change is decided by tapetrain.train.resume_checks.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from tapetrain import atomic_io
from tapetrain.checkpoint import disk, manifest, store
from tapetrain.checkpoint.completion import PendingCheckpoint
from tapetrain.checkpoint.zero3_reshard import SavedZero3, load_into
from tapetrain.distributed import DistEnv, agree, barrier
from tapetrain.errors import CheckpointError, ConfigError, DiskSpaceError, RunError
from tapetrain.model import ModelConfig
from tapetrain.train import resume_checks
from tapetrain.train.schedule import param_group_lists, set_schedule_position

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from tapetrain.config import RunConfig
    from tapetrain.data.prefetch import PrefetchingBatches
    from tapetrain.data.stream import BatchIterator

log = logging.getLogger("tapetrain.train")

CONFIG_HISTORY = store.CONFIG_HISTORY
UNIVERSAL_SCRATCH = "universal.tmp"  # under checkpoints/; removed by remove_incomplete like any *.tmp

# How a checkpoint reaches this start's partitioning: loaded as saved (same rank count, or ZeRO-0), through
# DeepSpeed's universal format (ZeRO-1/2 on another rank count), or re-partitioned by tapetrain (ZeRO-3).
Reshard = Literal["none", "universal", "zero3"]


@dataclass(frozen=True)
class TrainingProgress:
    """Where training stands: optimizer steps taken, tokens trained on, updates skipped for non-finite values."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class ResumePoint:
    """The complete checkpoint a start resumes from and its trainer_state.json."""

    checkpoint: Path
    state: dict[str, Any]

    @property
    def progress(self) -> TrainingProgress:
        return TrainingProgress(self.state["step"], self.state["tokens"], int(self.state.get("skipped_steps", 0)))


class CheckpointManager:
    """check() / check_training_setup() before the first write, prepare() before and restore() after the engine is
    built, save() while training. Holds what a later call needs: the resume point, the expected checkpoint size,
    the data's tokenizer and, between prepare() and restore(), the converted universal checkpoint."""

    def __init__(self, cfg: RunConfig, env: DistEnv, model_config: ModelConfig):
        self.cfg = cfg
        self.env = env
        self.model_config = model_config
        self.run_dir = Path(cfg.run.out_dir)
        self.resume: ResumePoint | None = None
        self.tokenizer_sha256: str | None = None  # recorded in every checkpoint, compared at the next resume
        self.data_settings: dict | None = None  # the same: what a step trains on
        self.checkpoint_bytes = 0  # expected size of one checkpoint (checked against free space before each save)
        self._universal: Path | None = None
        self._skipped: list[Path] = []  # damaged/incomplete checkpoints passed over (set aside after the load)
        self._ds_config: dict = {}  # written to ds_config.json once the checkpoint has loaded
        self._zero3: SavedZero3 | None = None  # ZeRO-3 on another rank count: read in prepare(), set in restore()
        self._pending: PendingCheckpoint | None = None  # the last save, until its background hashing is done

    # ---- check: on every rank, before anything is written -------------------------------------------------------

    def check(self) -> ResumePoint | None:
        """The checkpoint train.resume names (None for a fresh start), which must hold the model of the config;
        train.resume=none must not start among an earlier run's checkpoints. Raises ConfigError."""
        resume_checks.check_fresh_start(self.cfg, self.run_dir)
        checkpoint = self._find()
        self.resume = ResumePoint(checkpoint, store.read_trainer_state(checkpoint)) if checkpoint else None
        if checkpoint:
            resume_checks.check_same_model(checkpoint, self.model_config, self.run_dir)
        return self.resume

    def check_training_setup(self, tokenizer_sha256: str | None, data_settings: dict | None = None) -> None:
        """The trainable set, LoRA adapters and the data's tokenizer must be the checkpoint's (after check()).
        `data_settings` (resume_checks.data_settings) is recorded in every checkpoint; a change is logged."""
        self.tokenizer_sha256 = tokenizer_sha256
        self.data_settings = data_settings
        if self.resume:
            resume_checks.check_same_training_setup(self.resume.checkpoint, self.resume.state, self.cfg,
                                                    tokenizer_sha256)

    def _find(self) -> Path | None:
        """Collective (the checksums are spread over the ranks)."""
        resume, fallback = self.cfg.train.resume, self.cfg.train.resume_fallback
        if resume == "none":
            return None
        if resume == "auto":
            chosen = self._newest_intact(fallback)
            self._say_unchecked(chosen)
            return chosen
        path = Path(resume)
        if not (path / store.STATE_FILE).is_file():
            raise ConfigError(
                f"train.resume={resume!r} is not a complete checkpoint directory (no {store.STATE_FILE}); "
                "point it at RUN_DIR/checkpoints/step_XXXXXXXX or use 'auto'"
            )
        defect = self._verify(path)
        if defect is not None:  # named explicitly: never replaced by another checkpoint
            raise RunError(f"cannot resume from train.resume={resume!r}: the checkpoint is {defect.kind} "
                           f"({defect.detail}). Restore the file from a copy, or point train.resume at another "
                           f"checkpoint (`tapetrain data verify {path.parent.parent}` checks them all)")
        self._say_unchecked(path)
        return path

    def _newest_intact(self, fallback: bool) -> Path | None:
        """The newest complete checkpoint that matches its manifest. Newer damaged or incomplete ones are skipped
        with a warning naming each (train.resume_fallback=true) or refuse the start (false); never silently."""
        defects: list[tuple[Path, manifest.Defect]] = []
        chosen = None
        for _, path in store.step_directories(self.run_dir):
            defect = self._verify(path)
            if defect is None:
                chosen = path
                break
            defects.append((path, defect))
        if defects and (chosen is None or not fallback):
            raise RunError(_refusal(defects, chosen, self.run_dir))
        if self.env.is_main:
            for path, defect in defects:
                log.warning("skipping checkpoint %s: %s; resuming from %s instead (train.resume_fallback=true)",
                            path, defect, chosen)
        self._skipped = [path for path, _ in defects]
        return chosen

    def _verify(self, checkpoint: Path) -> manifest.Defect | None:
        """Sizes and checksums against manifest.json (collective)."""
        started = time.perf_counter()
        defect = manifest.find_defect(checkpoint, manifest.describe_shared)
        if defect is None and self.env.is_main and manifest.has_manifest(checkpoint):
            log.info("%s matches its manifest (sizes and xxh3-64 checksums, %.1f s)", checkpoint,
                     time.perf_counter() - started)
        return defect

    def _say_unchecked(self, checkpoint: Path | None) -> None:
        """A checkpoint from before manifests is resumed as it is, but not in silence."""
        if checkpoint is not None and self.env.is_main and not manifest.has_manifest(checkpoint):
            log.warning("%s has no manifest.json (written by a tapetrain before checkpoint manifests): its files "
                        "cannot be checked for damage; resuming from it as it is", checkpoint)

    def _reshard(self) -> Reshard:
        point = self.resume
        if point is None or point.state["world_size"] == self.env.world_size or point.state["zero_stage"] < 1:
            return "none"
        return "universal" if point.state["zero_stage"] <= 2 else "zero3"

    # ---- restore ------------------------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, ds_config: dict, *, total_params: int, trainable_params: int) -> dict:
        """The part of a restore that comes before the engine exists; returns the DeepSpeed config to build it with.

        Free space for one checkpoint (or the universal conversion), the conversion for another rank count (into
        checkpoints/universal.tmp/, removed again) and, for ZeRO-3 on another rank count, the checkpoint's weights
        (its fp32 masters and Adam moments are read here, so that a damaged file refuses the start, and set in
        restore()). The run's files are written by restore(), once the checkpoint has loaded."""
        d, env, point = self.cfg.deepspeed, self.env, self.resume
        self.checkpoint_bytes = disk.checkpoint_bytes(total_params, trainable_params, d.precision, d.zero_stage,
                                                      env.world_size, d.stage3_gather_16bit_weights_on_model_save)
        reshard = self._reshard()
        needed, what = self.checkpoint_bytes, "one checkpoint"
        if reshard == "universal":
            needed = max(needed, disk.universal_conversion_bytes(total_params, trainable_params, d.precision))
            what = f"converting {point.checkpoint.name} for {env.world_size} rank(s) (DeepSpeed's universal format)"
        agree(env, lambda: disk.require_free_space(self.run_dir, needed, what), on_main_only=True)

        self._ds_config = ds_config
        if reshard == "universal":
            self._universal = _convert_to_universal(point.checkpoint, env, point.state["world_size"])
        elif reshard == "zero3":
            self._zero3 = _read_zero3(point.checkpoint, env)  # agreed over the ranks: a damaged file stops them all
        if reshard == "universal":
            ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
            log.warning(
                "resuming %s on %d ranks (saved on %d) with ZeRO-%d through a universal checkpoint: weights, optimizer "
                "moments, LR schedule, step and data position are restored",
                point.checkpoint, env.world_size, point.state["world_size"], point.state["zero_stage"],
            )
        elif reshard == "zero3":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            # the model's weights (frozen ones included); the fp32 masters and moments follow in restore()
            weights: dict = {}
            self._load_or_stop(point.checkpoint, lambda: weights.update(get_fp32_state_dict_from_zero_checkpoint(
                str(point.checkpoint.parent), tag=point.checkpoint.name)))
            _load_full_weights(model, weights, env)
            log.warning(
                "resuming %s on %d ranks (saved on %d) with ZeRO-3 by re-partitioning its fp32 weights and Adam "
                "moments: weights, optimizer moments, LR schedule, step and data position are restored",
                point.checkpoint, env.world_size, point.state["world_size"],
            )
        return ds_config

    def restore(self, engine: DeepSpeedEngine, scheduler: torch.optim.lr_scheduler.LambdaLR,
                batches: BatchIterator) -> TrainingProgress:
        """The checkpoint's engine state (re-partitioned for ZeRO-3 on another rank count), data position and RNG
        states; the config's LR schedule, AdamW hyperparameters and clipping win from the resumed step on (the
        log lists what changed). Then, the load done on every rank, the run's files are written (config.yaml,
        config_history/, ds_config.json) and skipped checkpoints set aside. Returns where training continues (a
        fresh start: step 0)."""
        point = self.resume
        if point is None:
            self._commit(0)
            return TrainingProgress()
        cfg, env = self.cfg, self.env
        hyperparameters = group_hyperparameters(engine.basic_optimizer)  # the config's, before the load
        load = dict(load_optimizer_states=True, load_lr_scheduler_states=False)
        universal, zero3 = self._universal, self._zero3
        if universal is not None:
            try:
                self._load_or_stop(point.checkpoint, lambda: engine.load_checkpoint(str(universal.parent),
                                                                                    tag=universal.name, **load))
            finally:
                barrier()
                if env.is_main:
                    shutil.rmtree(universal.parent, ignore_errors=True)
                self._universal = None
        elif zero3 is not None:
            self._load_or_stop(point.checkpoint, lambda: load_into(engine, zero3))
            self._zero3 = None
        elif self._reshard() == "none":
            self._load_or_stop(point.checkpoint, lambda: engine.load_checkpoint(
                str(point.checkpoint.parent), tag=point.checkpoint.name, **load))
        self._load_or_stop(point.checkpoint, lambda: (batches.load_state_dict(point.state["data"]),
                                                      store.load_rng(point.checkpoint, env.rank)))
        start = point.progress
        apply_config_settings(engine, scheduler, cfg, start.step, hyperparameters)
        changes = resume_checks.setting_changes(point.state, cfg, self.run_dir)
        changes += resume_checks.data_setting_changes(point.state, self.data_settings)
        if changes:
            log.warning("resuming with changed settings, applied from step %d on: %s", start.step + 1,
                        "; ".join(changes))
        saved_sp = int(point.state.get("sequence_parallel", 1))
        if saved_sp != cfg.parallel.sequence_parallel:
            log.info("resuming with parallel.sequence_parallel=%d (saved with %d): how each sequence is split over "
                     "ranks changes, the model, data order and step do not", cfg.parallel.sequence_parallel, saved_sp)
        saved_cp = int(point.state.get("context_parallel", 1))
        if saved_cp != cfg.parallel.context_parallel:
            log.info("resuming with parallel.context_parallel=%d (saved with %d): how each sequence is split over "
                     "ranks changes, the model, data order and step do not", cfg.parallel.context_parallel, saved_cp)
        batch_change = resume_checks.batch_size_change(point.state, cfg.train.global_batch_size)
        if batch_change:
            log.warning("%s", batch_change)
        self._commit(start.step)
        log.info("resumed from %s at step %d (lr %.3g)", point.checkpoint, start.step, engine.get_lr()[0])
        return start

    def _load_or_stop(self, checkpoint: Path, load: Callable[[], object]) -> None:
        """Run one part of a checkpoint load on every rank; a failure on any rank stops every rank with one typed
        message (the run directory is still as it was: _commit comes after)."""

        def guarded() -> None:
            try:
                load()
            except Exception as err:  # noqa: BLE001 - torch/DeepSpeed report damaged files with any exception type
                raise RunError(_load_failure(checkpoint, err)) from err

        agree(self.env, guarded)

    def _commit(self, start_step: int) -> None:
        """The start can no longer fail on the checkpoint: remove interrupted saves of an earlier job (we hold the
        lock), set skipped checkpoints aside, write the run's files."""
        if self.env.is_main:
            store.remove_incomplete(self.run_dir)
            for path in self._skipped:
                aside = store.set_aside(path)
                log.warning("set the skipped checkpoint %s aside as %s (never resumed, exported or counted by "
                            "train.keep_last; delete it when it is no longer needed)", path.name, aside.name)
        self._write_run_files(self._ds_config, start_step)

    def _write_run_files(self, ds_config: dict, start_step: int) -> None:
        """config.yaml (this start's resolved config), one copy per start in config_history/, ds_config.json."""
        from tapetrain.config import save_resolved
        from tapetrain.train.run_tokenizer import keep_copy

        # The run keeps its tokenizer; config.yaml and every checkpoint's copy of the config name that copy.
        self.cfg = keep_copy(self.cfg, self.run_dir, write=self.env.is_main)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            history = self.run_dir / CONFIG_HISTORY
            history.mkdir(exist_ok=True)
            number = len(list(history.glob("start_*.yaml"))) + 1
            save_resolved(self.cfg, history / f"start_{number:03d}_from_{store.step_tag(start_step)}.yaml")
            save_resolved(self.cfg, self.run_dir / "config.yaml")
            atomic_io.write_json(self.run_dir / "ds_config.json", ds_config, newline=False)
        barrier()

    # ---- save ---------------------------------------------------------------------------------------------------

    def save(self, engine: DeepSpeedEngine, batches: BatchIterator | PrefetchingBatches,
             progress: TrainingProgress) -> None:
        """Checkpoint `progress.step` after checking free space; a full disk mid-save is a DiskSpaceError (the
        incomplete checkpoint is removed and never resumed from). The checkpoint becomes complete in the background
        (its manifest hashed off the training thread): wait_for_save() before the end of the run."""
        from tapetrain.config import dump_run_config

        self.wait_for_save()  # the previous checkpoint is complete (and pruned) before this one starts
        cfg, env, step = self.cfg, self.env, progress.step
        needed = self.checkpoint_bytes
        agree(env, lambda: disk.require_free_space(self.run_dir, needed, f"the checkpoint of step {step}"),
              on_main_only=True)
        state = {
            "step": step,
            "tokens": progress.tokens,
            "data": batches.state_dict(),
            "world_size": env.world_size,
            "sequence_parallel": cfg.parallel.sequence_parallel,  # execution only: any other value may resume
            "context_parallel": cfg.parallel.context_parallel,  # the same
            "zero_stage": cfg.deepspeed.zero_stage,
            "seed": cfg.run.seed,
            "skipped_steps": progress.skipped_steps,
            "tokenizer_sha256": self.tokenizer_sha256,
            **resume_checks.training_settings(cfg),
            "data_settings": self.data_settings,
        }
        # below the collective timeout: the other ranks wait for rank 0 in wait_for_save()'s agreement
        hash_timeout_s = cfg.deepspeed.timeout_minutes * 60 / 2
        try:
            self._pending = store.save_checkpoint(engine, self.run_dir, step, state, self.model_config.to_dict(),
                                                  env, cfg.train.keep_last, run_config_yaml=dump_run_config(cfg),
                                                  hash_timeout_s=hash_timeout_s)
        except Exception as err:  # DeepSpeed/torch report a full disk as a generic write failure
            free = disk.free_bytes(self.run_dir)
            if free >= needed and "No space left" not in str(err):
                raise
            if env.is_main:
                store.remove_incomplete(self.run_dir)
            raise DiskSpaceError(
                f"no space left on the device while saving the checkpoint of step {step} in "
                f"{self.run_dir / store.CHECKPOINTS} ({disk.human(free)} free, about {disk.human(needed)} needed): "
                f"{err}. The incomplete checkpoint is never resumed from. Free disk space or move run.out_dir, then "
                "start the same command again"
            ) from err

    def wait_for_save(self) -> None:
        """Collective: wait until the last save is complete (manifest written, renamed, pruned). A failure of its
        background thread on any rank stops every rank here with a CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is not None:
            agree(self.env, pending.join)

    def abandon_save(self, timeout_s: float) -> None:
        """Not collective, for a run that is stopping on an error: give the last save up to `timeout_s` to complete
        (its threads need no other rank's help but its part file), then leave it; a failure is only logged."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            if not pending.join(timeout_s):
                log.warning("the checkpoint of step %d was still being hashed; left incomplete (%s, never resumed "
                            "from)", pending.job.step, pending.job.tmp)
        except CheckpointError as err:
            log.warning("%s", err)


# ---- the config wins over the optimizer settings a load restores ---------------------------------------------------
# DeepSpeed's load_checkpoint restores the param groups (lr, betas, eps, weight decay) and ZeRO-1/2 their clipping
# threshold. But the LR is a function of (config, step) (tapetrain.train.schedule.lr_at), and a resume with a new
# optimizer section or train.grad_clip must train with the new values from the resumed step on.

HYPERPARAMETERS = ("betas", "eps", "weight_decay")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The config's betas/eps/weight_decay per param group, read before a checkpoint overwrites them (the
    no-decay group carries weight_decay 0, so the groups are told apart by position)."""
    return [{k: group[k] for k in HYPERPARAMETERS} for group in optimizer.param_groups]


def apply_config_settings(engine: DeepSpeedEngine, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: RunConfig,
                          step: int, hyperparameters: list[dict]) -> None:
    """After loading a checkpoint: the config's LR schedule position, AdamW hyperparameters and clipping."""
    for groups in param_group_lists(engine):
        if len(groups) != len(hyperparameters):
            raise RuntimeError(f"optimizer has {len(groups)} param groups, expected {len(hyperparameters)}")
        for group, values in zip(groups, hyperparameters, strict=True):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in values.items()})
    set_schedule_position(engine, scheduler, cfg.optim, cfg.train.steps, step)
    if hasattr(engine.optimizer, "clip_grad"):  # ZeRO-1/2 and the bf16 optimizer restore it from the checkpoint
        engine.optimizer.clip_grad = cfg.train.grad_clip


# ---- another rank count --------------------------------------------------------------------------------------------


def _convert_to_universal(checkpoint: Path, env: DistEnv, saved_world_size: int) -> Path:
    """Rank 0 converts a ZeRO checkpoint to DeepSpeed's universal format into checkpoints/universal.tmp/ (which
    also catches the `latest_universal` file the converter writes next to its output); any failure stops every
    rank with the converter's own error instead of silently resuming with fresh optimizer moments."""
    scratch = checkpoint.parent / UNIVERSAL_SCRATCH
    out = scratch / checkpoint.name

    def convert() -> None:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]  # checkpoints written before tapetrain recorded the universal info
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
            hint = " (no space left on the device)" if "No space left" in proc.stderr + proc.stdout else ""
            raise RunError(
                f"could not convert {checkpoint} (saved on {saved_world_size} ranks) for {env.world_size} rank(s)"
                f"{hint}: DeepSpeed's ds_to_universal failed:\n{tail}\nNothing was resumed or written. Resume on "
                f"{saved_world_size} ranks (no conversion needed), or fix the cause above and start again"
            )

    agree(env, convert, on_main_only=True)
    return out


def _read_zero3(checkpoint: Path, env: DistEnv) -> SavedZero3:
    """Every rank maps the checkpoint's ZeRO-3 files (each needs every saved partition of its own slices); a
    damaged file stops every rank with the reason instead of resuming with fresh moments."""
    saved: list[SavedZero3] = []
    agree(env, lambda: saved.append(SavedZero3(checkpoint)))
    return saved[0]


def _load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Load a full state dict; parameters partitioned by zero.Init are gathered one at a time."""
    params = dict(model.named_parameters())
    if not any(hasattr(p, "ds_id") for p in params.values()):
        model.load_state_dict(weights, strict=False)
        return
    import deepspeed

    with torch.no_grad():
        for name, param in params.items():
            if name in weights:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if env.is_main:
                        param.data.copy_(weights[name].to(param.dtype))


# ---- damaged checkpoints -------------------------------------------------------------------------------------------


def _refusal(defects: list[tuple[Path, manifest.Defect]], intact: Path | None, run_dir: Path) -> str:
    """The message of a start refused for damaged or incomplete checkpoints: each one, then the ways out."""
    found = "; ".join(f"{path} is {d.kind} ({d.detail})" for path, d in defects)
    if intact is None:
        return (f"cannot resume: no intact checkpoint in {run_dir / store.CHECKPOINTS}: {found}. Restore the files "
                "from a copy, or start over in a new run.out_dir")
    return (f"cannot resume: {found}. train.resume_fallback=false, so the run does not fall back to an earlier "
            f"checkpoint. Restore the file from a copy; or resume from the newest intact checkpoint, {intact}, with "
            f"train.resume_fallback=true (or train.resume={intact})")


def _load_failure(checkpoint: Path, err: Exception) -> str:
    """'could not load CHECKPOINT (FILE is not a complete torch file): ERROR ...' and the way out."""
    broken = [p.name for p in sorted(checkpoint.glob("*.pt")) if not zipfile.is_zipfile(p)]
    where = f" ({', '.join(broken)}: not a complete torch file)" if broken else ""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    checked = ("it matched its manifest, so it changed while loading or the manifest missed it"
               if manifest.has_manifest(checkpoint) else
               "it has no manifest.json (written by an older tapetrain), so it could not be checked before loading")
    return (f"could not load {checkpoint}{where}: {type(err).__name__}: {first}. The checkpoint is damaged; {checked}. "
            f"Nothing in the run directory was changed. Restore the file from a copy, or move {checkpoint.name} out "
            f"of {checkpoint.parent} to resume from the checkpoint before it")
