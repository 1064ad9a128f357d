"""Real 2-rank DeepSpeed runs (CPU, gloo) through the `deepspeed` launcher."""

import json

import pytest
from harness import launcher_cmd, losses, run, single_cmd, write_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_rank_zero_stage_trains(tmp_path, shard_dir, stage):
    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "c.yaml", shard_dir, out, deepspeed={"zero_stage": stage}, train={"steps": 8, "save_interval": 8}
    )
    run(launcher_cmd(cfg, 2))
    curve = losses(out)
    assert sorted(curve) == list(range(1, 9))
    assert sum(list(curve.values())[-3:]) / 3 < sum(list(curve.values())[:3]) / 3 - 0.1  # it learns
    state = json.loads((out / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 8 and state["tokens"] == 8 * 8 * 64
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage and ds["gradient_accumulation_steps"] == 2


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, shard_dir):
    """Same global batch (8): 2 ranks × micro 2 × accum 2 vs 1 rank × micro 2 × accum 4, fp32. Validation too: it
    used to read eval_steps micro batches per rank, so 2 ranks scored twice the samples of 1 rank."""
    one = tmp_path / "one"
    two = tmp_path / "two"
    val = {"data": {"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64},
           "train": {"eval_interval": 3, "eval_steps": 1}}
    run(single_cmd(write_config(tmp_path / "1.yaml", shard_dir, one, **val)))
    launched = run(launcher_cmd(write_config(tmp_path / "2.yaml", shard_dir, two, **val), 2))
    assert "FutureWarning" not in launched.stderr + launched.stdout  # torch's deprecation of DeepSpeed's collectives
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])
    val_a, val_b = val_losses(one), val_losses(two)
    assert sorted(val_a) == sorted(val_b) == [3, 6]
    for step in val_a:
        assert abs(val_a[step] - val_b[step]) < 1e-4, (step, val_a[step], val_b[step])


def val_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def grad_norms(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}


def test_logged_grad_norm_is_the_pre_clip_norm_on_every_stage(tmp_path, shard_dir):
    """ZeRO-0 fp32 logged the norm after DeepSpeed had clipped (grad_clip exactly, every step) while ZeRO-1/2/3
    logged the norm before clipping. With a clip far below the real norm every step is clipped: both stages must
    log the same norms, all above the clip value."""
    norms = {}
    for stage in (0, 2):
        out = tmp_path / f"zero{stage}"
        cfg = write_config(tmp_path / f"{stage}.yaml", shard_dir, out, deepspeed={"zero_stage": stage},
                           train={"steps": 3, "save_interval": 3, "grad_clip": 0.05})
        run(launcher_cmd(cfg, 2))
        norms[stage] = grad_norms(out)
    assert sorted(norms[0]) == sorted(norms[2]) == [1, 2, 3]
    for step in norms[0]:
        assert norms[0][step] > 0.05 * 1.5 and norms[2][step] > 0.05 * 1.5, (step, norms)
        assert abs(norms[0][step] - norms[2][step]) <= 1e-4 * norms[2][step], (step, norms)
