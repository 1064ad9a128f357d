"""Real 2-rank DeepSpeed runs (CPU, gloo) through the `deepspeed` launcher.

Economy: every 2-rank training of this file (ZeRO-1/2/3 for 8 steps, the run with validation, ZeRO-0 and ZeRO-2
with a small clip) runs in one launch of run_cases_worker.py, one case after another; each test reads its case's
run directory."""

import json
from pathlib import Path

import pytest
from harness import losses, run, script_launcher_cmd, single_cmd, write_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("run_cases_worker.py")


def with_validation(shard_dir: Path) -> dict:
    return {"data": {"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64},
            "train": {"eval_interval": 3, "eval_steps": 1}}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, shard_dir) -> tuple[Path, str]:
    """(root, the launcher's output): root/zero{1,2,3} (8 steps), root/two (6 steps with validation),
    root/clip{0,2} (3 steps, grad_clip 0.05), all run by one 2-rank launch."""
    root = tmp_path_factory.mktemp("zero")
    configs = [write_config(root / f"zero{stage}.yaml", shard_dir, root / f"zero{stage}",
                            deepspeed={"zero_stage": stage}, train={"steps": 8, "save_interval": 8})
               for stage in (1, 2, 3)]  # fmt: skip
    configs.append(write_config(root / "two.yaml", shard_dir, root / "two", **with_validation(shard_dir)))
    configs += [write_config(root / f"clip{stage}.yaml", shard_dir, root / f"clip{stage}",
                             deepspeed={"zero_stage": stage}, train={"steps": 3, "save_interval": 3, "grad_clip": 0.05})
                for stage in (0, 2)]  # fmt: skip
    cases = root / "cases.json"
    cases.write_text(json.dumps([{"config": str(c), "overrides": []} for c in configs]))
    launched = run(script_launcher_cmd(WORKER, 2, str(cases)))
    return root, launched.stdout + launched.stderr


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_rank_zero_stage_trains(two_rank_runs, stage):
    out = two_rank_runs[0] / f"zero{stage}"
    curve = losses(out)
    assert sorted(curve) == list(range(1, 9))
    assert sum(list(curve.values())[-3:]) / 3 < sum(list(curve.values())[:3]) / 3 - 0.1  # it learns
    state = json.loads((out / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 8 and state["tokens"] == 8 * 8 * 64
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage and ds["gradient_accumulation_steps"] == 2


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, shard_dir, two_rank_runs):
    """Same global batch (8): 2 ranks × micro 2 × accum 2 vs 1 rank × micro 2 × accum 4, fp32. Validation too: it
    used to read eval_steps micro batches per rank, so 2 ranks scored twice the samples of 1 rank."""
    one = tmp_path / "one"
    two = two_rank_runs[0] / "two"
    run(single_cmd(write_config(tmp_path / "1.yaml", shard_dir, one, **with_validation(shard_dir))))
    # torch's deprecation of DeepSpeed's collectives (Python prints a warning once per process: this launch's output
    # covers all its cases)
    assert "FutureWarning" not in two_rank_runs[1]
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


def test_logged_grad_norm_is_the_pre_clip_norm_on_every_stage(two_rank_runs):
    """ZeRO-0 fp32 logged the norm after DeepSpeed had clipped (grad_clip exactly, every step) while ZeRO-1/2/3
    logged the norm before clipping. With a clip far below the real norm every step is clipped: both stages must
    log the same norms, all above the clip value."""
    norms = {stage: grad_norms(two_rank_runs[0] / f"clip{stage}") for stage in (0, 2)}
    assert sorted(norms[0]) == sorted(norms[2]) == [1, 2, 3]
    for step in norms[0]:
        assert norms[0][step] > 0.05 * 1.5 and norms[2][step] > 0.05 * 1.5, (step, norms)
        assert abs(norms[0][step] - norms[2][step]) <= 1e-4 * norms[2][step], (step, norms)
