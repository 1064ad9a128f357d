"""Sequence parallelism (DeepSpeed-Ulysses) through real trainings on CPU ranks over gloo.

Every positional encoding at parallel.sequence_parallel=2 on 2 ranks reproduces 1 rank at SP=1 with the same global
batch, with ZeRO-2 and ZeRO-3: per-step losses, the validation loss and the final weights (fp32, 1e-5). So do MQA
(keys and values expanded before the exchange), the supervised (answer-only) path, activation checkpointing with a
random position offset, and the Triton kernel (TRITON_INTERPRET=1); DP 2 × SP 2 on 4 ranks too. A run killed with
SIGKILL at SP=2 resumes with bit-identical losses, and one resumed at SP=1 on 1 rank continues the same losses.

Economy: all 1-rank references run in one process and all SP=2 cases in one 2-rank launch (run_cases_worker.py),
so imports, the launch and DeepSpeed's first engine are paid once per launch, not once per case.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, env, losses, run, script_launcher_cmd, single_cmd, write_config
from test_resume_and_faults import wait_for

from tapetrain.data.arith import VOCAB_SIZE, write_arith_data

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("run_cases_worker.py")
STEPS = 5
KILL_STEPS = 16  # long enough that the kill (after step 2) lands mid-run
RESUME_FROM = 10  # the step whose checkpoint resumes with another SP degree
TOL = 1e-5

PES = ("tape", "rope", "nope", "alibi", "xpos", "fire", "randpe")
# name -> overrides of the base config (a tiny model: 4 query heads, 2 KV heads, so every case is GQA; seq 64)
CASES: dict[str, list[str]] = {f"{pe}-z{stage}": [f"model.pe={pe}", f"deepspeed.zero_stage={stage}"]
                               for pe in PES for stage in (2, 3)}
CASES.update({
    # one KV head, fewer than the 2 ranks: keys and values are expanded to the query heads before the exchange;
    # the eager backend inside
    "tape-mqa": ["model.pe=tape", "model.n_kv_heads=1"],
    "rope-mqa-eager": ["model.pe=rope", "model.n_kv_heads=1", "model.attn_backend=eager"],
    # xPos's decay in several query blocks, FIRE shared by the layers, one RandPE draw for all layers, ZeRO-1
    "xpos-blocks-z1": ["model.pe=xpos", "model.xpos_scale_base=16", "deepspeed.zero_stage=1"],
    "fire-shared": ["model.pe=fire", "model.fire_shared=true"],
    "randpe-one-draw": ["model.pe=randpe", "model.randpe_per_layer=false"],
    "tape-ckpt-offset": ["model.pe=tape", "model.activation_checkpointing=true", "train.random_position_offset=100",
                         "model.loss_backend=plain"],
    "tape-triton": ["model.pe=tape", "model.attn_backend=triton", "data.seq_len=32", "train.steps=2",
                    "train.global_batch_size=4", "data.val=[]", "train.eval_interval=0"],
    "kill-baseline": ["model.pe=tape", f"train.steps={KILL_STEPS}", "train.save_interval=2", "data.val=[]",
                      "train.eval_interval=0"],
})
SUPERVISED = "tape-supervised"  # on arith examples: answer-only labels, its own config
# DP 2 × SP 2. Not RandPE: its draws come from each data-parallel rank's random stream, so under data parallelism
# (with or without SP) a sequence's draw depends on which rank reads it.
FOUR_RANKS = ("tape-z2", "alibi-z3", "fire-z2")


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "data"
    write_arith_data(str(out), max_digits=3, eval_max_digits=4, train_examples=600, eval_per_cell=5, progress=False)
    return out


def base_config(root: Path, shard_dir: Path, arith_dir: Path) -> dict[str, Path]:
    # Adam's eps at 1e-6 (not 1e-8): a few parameters have a gradient that is zero up to float noise (FIRE's output
    # bias, a constant per head under the softmax) and Adam would scale that noise, whose sign no reordering of
    # sums reproduces, to steps of ~lr. Real gradients here are far above 1e-6.
    optim = {"eps": 1e-6}
    lm = write_config(root / "lm.yaml", shard_dir, root / "unused", optim=optim,
                      data={"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64},
                      train={"steps": STEPS, "save_interval": 0, "eval_interval": STEPS, "eval_steps": 1})
    examples = write_config(root / "examples.yaml", arith_dir, root / "unused", optim=optim,
                            model={"vocab_size": VOCAB_SIZE, "max_seq_len": 16}, data={"seq_len": 14},
                            train={"steps": STEPS, "save_interval": 0})
    return {"lm": lm, "examples": examples}


def cases_file(path: Path, configs: dict[str, Path], out: Path, names, extra: list[str]) -> Path:
    cases = []
    for name in names:
        config, overrides = (configs["examples"], ["model.pe=tape"]) if name == SUPERVISED else (
            configs["lm"], CASES[name])
        cases.append({"config": str(config), "overrides": [f"run.out_dir={out / name}", *overrides, *extra]})
    path.write_text(json.dumps(cases))
    return path


def worker_env() -> dict:
    e = env()
    e["TRITON_INTERPRET"] = "1"  # the Triton kernel on CPU (tape-triton); other cases pick sdpa on CPU
    return e


def run_worker(cmd: list[str], timeout: int = 1500) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, shard_dir, arith_dir):
    """Every case once on 1 rank (SP=1, one process) and once on 2 ranks at SP=2 (one launch)."""
    root = tmp_path_factory.mktemp("sp")
    configs = base_config(root, shard_dir, arith_dir)
    names = [*CASES, SUPERVISED]
    one = cases_file(root / "one.json", configs, root / "one", names, [])
    two = cases_file(root / "two.json", configs, root / "two", names, ["parallel.sequence_parallel=2"])
    run_worker([sys.executable, str(WORKER), str(one)])
    run_worker(script_launcher_cmd(WORKER, 2, str(two)))
    return root, configs


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = json.loads((run_dir / "DONE.json").read_text())
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step_{state['step']:08d}")


def val_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def assert_same_run(reference: Path, other: Path, name: str) -> None:
    a, b = losses(reference), losses(other)
    assert sorted(a) == sorted(b) and len(a) >= 2, (name, a, b)
    for step in a:
        assert abs(a[step] - b[step]) <= TOL, (name, step, a[step], b[step])
    assert val_losses(reference).keys() == val_losses(other).keys()
    for step, value in val_losses(reference).items():
        assert abs(value - val_losses(other)[step]) <= TOL, (name, "val", step, value, val_losses(other)[step])
    wa, wb = final_weights(reference), final_weights(other)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= TOL, (name, "weights", worst)


def test_sp2_on_two_ranks_reproduces_one_rank(sp_runs):
    root, _ = sp_runs
    for name in [*CASES, SUPERVISED]:
        assert_same_run(root / "one" / name, root / "two" / name, name)
    ds = json.loads((root / "two" / "tape-z2" / "ds_config.json").read_text())
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == 4  # micro 2 × 1 data-parallel rank × 4 = global batch 8
    state = json.loads((root / "two" / "tape-z2" / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert state["sequence_parallel"] == 2 and state["world_size"] == 2 and state["tokens"] == STEPS * 8 * 64
    assert val_losses(root / "one" / "tape-z2"), "validation ran"


def test_dp2_sp2_on_four_ranks_reproduces_one_rank(sp_runs):
    root, configs = sp_runs
    four = cases_file(root / "four.json", configs, root / "four", FOUR_RANKS, ["parallel.sequence_parallel=2"])
    run_worker(script_launcher_cmd(WORKER, 4, str(four)))
    for name in FOUR_RANKS:
        assert_same_run(root / "one" / name, root / "four" / name, name)
    ds = json.loads((root / "four" / "tape-z2" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2  # 2 × 2 data-parallel × 2


def copy_until(run_dir: Path, out: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after checkpoint `step`."""
    shutil.copytree(run_dir, out)
    for checkpoint in (out / "checkpoints").glob("step_*"):
        if int(checkpoint.name.split("_")[1]) > step:
            shutil.rmtree(checkpoint)
    (out / "DONE.json").unlink()
    return out


def test_sigkill_at_sp2_resumes_identically_and_sp_changes_on_resume(sp_runs, tmp_path):
    """Killed at SP 2 and resumed: bit-identical. A checkpoint resumed with another SP degree on another number of
    ranks (ZeRO-2 through DeepSpeed's universal checkpoint, weights and Adam moments) continues the same losses: SP 2
    on 2 ranks -> SP 1 on 1 rank, and SP 1 on 1 rank -> SP 2 on 2 ranks."""
    root, configs = sp_runs
    baseline = root / "two" / "kill-baseline"
    killed = tmp_path / "kill-baseline"
    sp2 = ["parallel.sequence_parallel=2"]
    cmd = script_launcher_cmd(WORKER, 2, str(cases_file(tmp_path / "k.json", configs, tmp_path, ["kill-baseline"],
                                                        sp2)))
    proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(killed / "checkpoints" / "step_00000002" / "trainer_state.json")
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no chance to clean up
    proc.wait()
    assert not (killed / "DONE.json").exists()

    to_sp2 = copy_until(root / "one" / "kill-baseline", tmp_path / "to-sp2" / "kill-baseline", RESUME_FROM)
    to_sp1 = copy_until(baseline, tmp_path / "to-sp1", RESUME_FROM)
    resume = json.loads((tmp_path / "k.json").read_text())  # the killed run, then the SP 1 run at SP 2
    resume.append({**resume[0], "overrides": [f"run.out_dir={to_sp2}", *resume[0]["overrides"][1:]]})
    (tmp_path / "k.json").write_text(json.dumps(resume))
    run_worker(cmd)  # train.resume: auto
    assert losses(killed) == losses(baseline)  # bit-identical per-step losses, every step logged once

    log = run(single_cmd(configs["lm"], f"run.out_dir={to_sp1}", *CASES["kill-baseline"])).stderr
    assert "through a universal checkpoint" in log and "parallel.sequence_parallel=1 (saved with 2)" in log
    for moved in (to_sp1, to_sp2):
        a, b = losses(baseline), losses(moved)
        assert sorted(b) == list(range(1, KILL_STEPS + 1))
        for step in range(RESUME_FROM + 1, KILL_STEPS + 1):
            assert abs(a[step] - b[step]) <= 1e-4, (moved.name, step, a[step], b[step])
    state = json.loads((to_sp2 / "checkpoints" / f"step_{KILL_STEPS:08d}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["sequence_parallel"] == 2


def test_a_world_size_that_sp_does_not_divide_stops_before_writing(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", shard_dir, out, parallel={"sequence_parallel": 2})
    proc = subprocess.run(single_cmd(cfg), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "parallel.sequence_parallel=2 does not divide the 1 rank(s) of this launch" in proc.stderr
    assert "launch a multiple of 2 ranks" in proc.stderr
    assert not out.exists()
