"""parallel.context_parallel: the errors a config gets before anything runs, the batch arithmetic, the DeepSpeed JSON
and the groups --print-config shows. (The trainings: tests/distributed/test_sequence_parallel.py.)"""

from __future__ import annotations

import pytest

from tapetrain.config import build_deepspeed_config, load_run_config
from tapetrain.errors import ConfigError
from tapetrain.parallel.layout import ParallelLayout
from tests.unit.test_sequence_parallel_config import config_file

RING = ["parallel.sequence_parallel=1", "parallel.context_parallel=2"]


def refused(tmp_path, *overrides: str, world: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_run_config(config_file(tmp_path), [*RING, *overrides])
        if world is not None:
            cfg.resolve(world_size=world, device_type="cpu")
    return str(err.value)


def test_a_sequence_that_does_not_split_into_2r_chunks_is_refused(tmp_path):
    msg = refused(tmp_path, "data.seq_len=62")
    assert "data.seq_len: 62 is not a multiple of 2 × parallel.context_parallel × parallel.sequence_parallel = 4" in msg
    assert "use data.seq_len=60 (or 64)" in msg
    msg = refused(tmp_path, "parallel.sequence_parallel=2", "data.seq_len=36")
    assert "= 8" in msg


def test_a_world_the_ring_does_not_divide_is_refused(tmp_path):
    msg = refused(tmp_path, world=3)
    assert "parallel.context_parallel=2 × parallel.sequence_parallel=1 = 2 ranks share each sequence" in msg
    assert "launch a multiple of 2 ranks" in msg


@pytest.mark.parametrize(("key", "words"), [("model.s2_attn=true", "shifted sparse attention"),
                                            ("model.compile=true", "torch.compile")])
def test_what_the_ring_cannot_carry_is_refused(tmp_path, key: str, words: str):
    msg = refused(tmp_path, "model.pe=rope", key)
    assert words in msg and "parallel.context_parallel=1" in msg


def test_a_ring_by_ulysses_counts_its_ranks_once_per_sequence(tmp_path):
    cfg = load_run_config(config_file(tmp_path), ["parallel.sequence_parallel=2", "parallel.context_parallel=2"])
    cfg = cfg.resolve(world_size=8, device_type="cpu")
    assert cfg.parallel.ranks_per_sequence == 4 and cfg.data_parallel(8) == 2
    assert cfg.grad_accum_steps(8) == 2  # global 8 = micro 2 × 2 data-parallel ranks × 2
    ds = build_deepspeed_config(cfg, 8)
    assert ds["sequence_parallel_size"] == 4 and ds["train_batch_size"] == 8


def test_the_layout_of_rings_and_ulysses_groups():
    layout = ParallelLayout(8, 2, 2)
    assert layout.groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.ulysses_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.rings() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert (layout.data_parallel, layout.data_parallel_rank(5), layout.sequence_rank(5)) == (2, 1, 1)
    lines = layout.describe(64)
    assert lines[0].startswith("context parallel: 2 (ring attention): rings [0, 2] [1, 3] [4, 6] [5, 7]")
    assert "sequence parallel: 2 (DeepSpeed-Ulysses) inside each ring rank" in lines[1]
    with pytest.raises(ValueError, match="does not divide 6 ranks"):
        ParallelLayout(6, 2, 2)
