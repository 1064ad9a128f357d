"""RunConfig: one YAML file (+ `base:` includes + KEY=VALUE overrides) -> validated, typed sections.

cfg = load_run_config("configs/tiny-cpu.yaml", ["train.steps=20"])
cfg = cfg.resolve(world_size=dist.world_size, device_type="cpu")   # batch-size / device checks
save_resolved(cfg, f"{cfg.run.out_dir}/config.yaml")              # loads back to an equal RunConfig
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import yaml

from tapetrain import atomic_io
from tapetrain.config.checks import check_for_world, check_run_config, grad_accum_steps
from tapetrain.config.sections import (
    DataSection,
    DeepSpeedSection,
    LoggingSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    TrainSection,
)
from tapetrain.config.typed import Locate, UnknownKeys, build, convert, gather, suggest, to_plain, where
from tapetrain.config.yaml_io import apply_overrides, locator, read_with_bases
from tapetrain.errors import ConfigError


@dataclass
class RunConfig:
    """Everything a run needs; the YAML file has one mapping per field below."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    @classmethod
    def from_dict(cls, raw: Mapping, locate: Locate | None = None) -> RunConfig:
        """Typed, validated config from plain data (as read from YAML); `locate` maps keys to 'file:line'."""
        locate = locate or (lambda key: "")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a run config must be a mapping of sections, got {type(raw).__name__}")
        raw = dict(raw)
        for name in SECTION_NAMES:
            if name in raw and raw[name] is None:
                raw[name] = {}  # an empty section ("train:" with nothing under it)
            if name in raw and not isinstance(raw[name], Mapping):
                raise ConfigError(
                    f"{name}: expected a mapping of keys, got {raw[name]!r}{where(locate, name)}; "
                    f"write it as '{name}:' followed by indented key: value lines"
                )
        if "model" in raw:
            raw["model"] = _expand_preset(raw["model"], locate)
        problems = []
        for key in (str(k) for k in raw if k not in SECTION_NAMES):
            hint = suggest(key, list(SECTION_NAMES))
            moved = _section_of(key) if "did you mean" not in hint else None
            if moved:
                hint = f"; did you mean {moved!r}? (keys go under their section)"
            problems.append(f"unknown top-level key {key!r}{where(locate, key)}{hint}")
        sections, errors = {}, []  # every section is read, so every unknown key is reported at once
        for name, tp in _section_types().items():
            sections[name], error = gather(problems, build, tp, raw.get(name, {}), name, locate, elsewhere=_section_of)
            errors += [error] if error else []
        if problems:
            raise UnknownKeys(problems)
        if errors:
            raise errors[0]
        cfg = cls(**sections)
        if cfg.data.seq_len is None:
            cfg.data.seq_len = cfg.model.max_seq_len
        check_run_config(cfg, locate)
        return cfg

    def to_dict(self) -> dict:
        """Plain nested dicts/lists (YAML-ready); `from_dict(to_dict())` gives an equal config.

        The model section lists `preset` and `init_from` first and then every ModelConfig field explicitly.
        """
        out = to_plain(self)
        model = out["model"]
        out["model"] = {"preset": model.pop("preset"), "init_from": model.pop("init_from"), **model}
        return out

    def resolve(self, world_size: int, device_type: str | None = None) -> RunConfig:
        """Checks that need the world size (and device type: 'cpu' or 'cuda'); returns a copy with
        train.global_batch_size filled in (null -> micro_batch_size × data-parallel ranks)."""
        check_for_world(self, world_size, device_type)
        global_batch = self.train.global_batch_size or self.train.micro_batch_size * self.data_parallel(world_size)
        return replace(self, train=replace(self.train, global_batch_size=global_batch))

    def data_parallel(self, world_size: int) -> int:
        """Ranks that read different samples: world size / (parallel.sequence_parallel × context_parallel)."""
        return world_size // self.parallel.ranks_per_sequence

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro steps per optimizer step on each rank."""
        return grad_accum_steps(self.train, world_size, self.parallel.ranks_per_sequence)

    def global_batch_size(self, world_size: int) -> int:
        """Sequences per optimizer step over all ranks (each counted once: a sequence-parallel group shares one)."""
        return self.train.micro_batch_size * self.data_parallel(world_size) * self.grad_accum_steps(world_size)

    def tokens_per_step(self, world_size: int) -> int:
        """Training tokens per optimizer step over all ranks."""
        assert self.data.seq_len is not None
        return self.global_batch_size(world_size) * self.data.seq_len


SECTION_NAMES = tuple(f.name for f in dataclasses.fields(RunConfig))


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in SECTION_NAMES}


def _section_of(name: str) -> str | None:
    """'optim.lr' for 'lr': the section that owns a key written in the wrong place (or at the top level)."""
    for section, cls in _section_types().items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return f"{section}.{name}"
    return None


def _expand_preset(model: Mapping, locate: Locate) -> dict:
    """`preset: NAME` + overrides -> the preset's ModelConfig values updated with the keys written."""
    model = dict(model)
    preset = model.get("preset")
    if preset is None:
        return model
    convert(preset, str, "model.preset", locate)
    from tapetrain.model.presets import get_preset

    try:
        values = get_preset(preset)
    except ConfigError as err:
        raise ConfigError(f"{err}{where(locate, 'model.preset')}") from None
    return {**values, **model}


def load_run_config(path: str, overrides: Iterable[str] = ()) -> RunConfig:
    """Load, merge `base:` includes, apply KEY=VALUE overrides, type-check and validate a run config.

    A `run.seed=S` override without a `run.out_dir` override moves the run to OUT_DIR/seed-S (`seed_run_dir`)."""
    overrides = list(overrides)
    data, locations = read_with_bases(str(path))
    data = apply_overrides(data, overrides, locations)
    return place_seed_run(RunConfig.from_dict(data, locator(locations)), overrides)


SEED_DIR = re.compile(r"^seed-(\d+)$")


def seed_run_dir(out_dir: str, seed: int) -> str:
    """runs/NAME -> runs/NAME/seed-S; a directory already named seed-T is replaced (runs/NAME/seed-T -> seed-S),
    so reloading a seed run's own config.yaml with another seed never nests seed-T/seed-S."""
    parent, name = os.path.split(out_dir.rstrip("/\\") or out_dir)
    base = parent if SEED_DIR.match(name) else os.path.join(parent, name)
    return os.path.join(base, f"seed-{seed}")


def place_seed_run(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """The config with run.out_dir = seed_run_dir(...) when the command line sets run.seed but not run.out_dir.

    Why: a seed sweep (`tapetrain train CONFIG run.seed=S` for several S) would otherwise resume, or refuse, the
    one run directory of the config; per-seed directories are also what `tapetrain compare` groups by label.
    run.name (if unset) becomes NAME-seed-S so logs and TensorBoard tell the seeds apart."""
    keys = {text.partition("=")[0].strip() for text in overrides}
    if "run.seed" not in keys or keys & {"run", "run.out_dir"}:
        return cfg
    out_dir = seed_run_dir(cfg.run.out_dir, cfg.run.seed)
    name = cfg.run.name or f"{os.path.basename(os.path.dirname(out_dir))}-seed-{cfg.run.seed}"
    return replace(cfg, run=replace(cfg.run, out_dir=out_dir, name=name))


def _absolute(path: str | None) -> str | None:
    from tapetrain.data.remote import is_remote

    return path if not path or is_remote(path) else os.path.abspath(os.path.expanduser(path))


def with_absolute_paths(cfg: RunConfig) -> RunConfig:
    """cfg with its local paths absolute (as the run resolves them from its working directory), so that the run
    directory's config.yaml means the same from any working directory."""
    data = dataclasses.replace(
        cfg.data,
        train=[dataclasses.replace(s, path=_absolute(s.path)) for s in cfg.data.train],
        val=[dataclasses.replace(s, path=_absolute(s.path)) for s in cfg.data.val],
        tokenizer=_absolute(cfg.data.tokenizer),
        cache_dir=_absolute(cfg.data.cache_dir),
    )
    init_from = cfg.model.init_from
    if init_from and os.path.exists(init_from):  # else a name the loader resolves (kept as written)
        init_from = os.path.abspath(init_from)
    return dataclasses.replace(cfg, data=data, run=dataclasses.replace(cfg.run, out_dir=_absolute(cfg.run.out_dir)),
                               model=dataclasses.replace(cfg.model, init_from=init_from))


def dump_run_config(cfg: RunConfig) -> str:
    """The config as YAML text (every key explicit)."""
    header = "# Resolved tapetrain run config (generated; load with tapetrain.config.load_run_config).\n"
    return header + yaml.safe_dump(
        cfg.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True
    )


def save_resolved(cfg: RunConfig, path: str) -> None:
    """Write the config as YAML atomically (atomic_io)."""
    atomic_io.write_text(path, dump_run_config(cfg), parents=True)
