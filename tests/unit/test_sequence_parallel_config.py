"""parallel.sequence_parallel: the errors a config gets before anything runs or is written, the batch arithmetic,
the DeepSpeed JSON and what --print-config shows about the groups. (The training itself: tests/distributed/
test_sequence_parallel.py.)"""

from __future__ import annotations

import textwrap

import pytest

from tapetrain.config import build_deepspeed_config, load_run_config
from tapetrain.config.checks import sequence_parallel_heads_problem
from tapetrain.errors import ConfigError
from tapetrain.parallel.layout import ParallelLayout, local_ranks_warning

CONFIG = """\
model:
  preset: tiny
data:
  train: shards
  seq_len: 64
train:
  steps: 10
  micro_batch_size: 2
  global_batch_size: 8
deepspeed:
  precision: fp32
parallel:
  sequence_parallel: 2
"""


def config_file(tmp_path, text: str = CONFIG) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def refused(tmp_path, *overrides: str, world: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_run_config(config_file(tmp_path), list(overrides))
        if world is not None:
            cfg.resolve(world_size=world, device_type="cpu")
    return str(err.value)


def test_head_count_not_divisible(tmp_path):
    msg = refused(tmp_path, "parallel.sequence_parallel=3", "data.seq_len=63")
    assert "parallel.sequence_parallel: 3 does not divide model.n_heads=4" in msg
    assert "(at override 'parallel.sequence_parallel=3'); set parallel.sequence_parallel to a divisor of 4: 1, 2, " \
           "4" in msg
    # after model.init_from has set the head count (checked again when the run starts)
    assert sequence_parallel_heads_problem(32, 8) is None
    assert "divisor of 12: 1, 2, 3, 4, 6, 12" in sequence_parallel_heads_problem(12, 8)[1]


def test_sequence_length_not_divisible(tmp_path):
    msg = refused(tmp_path, "data.seq_len=63")
    assert "data.seq_len: 63 is not a multiple of parallel.sequence_parallel=2" in msg
    assert "use data.seq_len=62 (or 64)" in msg


def test_world_size_not_divisible(tmp_path):
    msg = refused(tmp_path, world=3)
    assert "parallel.sequence_parallel=2 does not divide the 3 rank(s) of this launch" in msg
    assert "launch a multiple of 2 ranks, or set parallel.sequence_parallel to one of 1" in msg


def test_s2_attn_and_compile_are_refused(tmp_path):
    msg = refused(tmp_path, "model.pe=rope", "model.s2_attn=true")
    assert "model.s2_attn" in msg and "set model.s2_attn=false" in msg and "parallel.sequence_parallel=1" in msg
    msg = refused(tmp_path, "model.compile=true")
    assert "model.compile" in msg and "set model.compile=false" in msg


def test_bad_values_and_reserved_deepspeed_keys(tmp_path):
    assert "parallel.sequence_parallel: must be > 0, got 0" in refused(tmp_path, "parallel.sequence_parallel=0")
    msg = refused(tmp_path, "deepspeed.extra={sequence_parallel_size: 2}")
    assert "deepspeed.extra.sequence_parallel_size" in msg and "set parallel.sequence_parallel instead" in msg


def test_gpus_per_node_warning():
    assert local_ranks_warning(2, 8) is None and local_ranks_warning(8, 8) is None
    assert local_ranks_warning(4, None) is None
    warning = local_ranks_warning(16, 8)
    assert "parallel.sequence_parallel=16 is larger than the 8 GPU(s) per node" in warning
    assert "parallel.sequence_parallel=8" in warning


def test_batch_arithmetic_counts_each_sequence_once(tmp_path):
    cfg = load_run_config(config_file(tmp_path)).resolve(world_size=4, device_type="cpu")
    assert cfg.data_parallel(4) == 2 and cfg.grad_accum_steps(4) == 2 and cfg.global_batch_size(4) == 8
    assert cfg.tokens_per_step(4) == 8 * 64
    ds = build_deepspeed_config(cfg, 4)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2
    assert ds["sequence_parallel_size"] == 2
    default = load_run_config(config_file(tmp_path), ["train.global_batch_size=null"]).resolve(8, "cpu")
    assert default.train.global_batch_size == 2 * 4  # micro batch × data-parallel ranks
    msg = refused(tmp_path, "train.global_batch_size=6", world=4)
    assert "train.micro_batch_size × data-parallel ranks (world size 4 / parallel.sequence_parallel 2)" in msg
    assert "use train.global_batch_size=4 (or 8)" in msg
    assert "sequence_parallel_size" not in build_deepspeed_config(
        load_run_config(config_file(tmp_path), ["parallel.sequence_parallel=1"]).resolve(4, "cpu"), 4)


def test_layout_matches_deepspeeds_groups():
    layout = ParallelLayout(8, 4)
    assert layout.groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # parallel_state_sp: N consecutive ranks
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.sequence_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError):
        ParallelLayout(6, 4)


def test_print_config_shows_the_groups(tmp_path, capsys):
    from tapetrain.cli import main

    assert main(["train", config_file(tmp_path), "--print-config", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: 2 (DeepSpeed-Ulysses): groups [0, 1] [2, 3]; each rank holds 32 of every " \
           "sequence's 64 tokens" in out
    assert "data parallel: 2 (rank // 2)" in out
    assert "gradient accumulation: 2 (global batch 8 = micro batch 2 x 2 data-parallel rank(s) x 2)" in out
    assert '"sequence_parallel_size": 2' in out
