"""Exact resume after SIGKILL, interrupted saves, SIGTERM, NaN policy, resume on another rank count, hostfile launch."""

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import DEEPSPEED, REPO, env, free_port, launcher_cmd, losses, run, single_cmd, write_config

pytestmark = pytest.mark.slow


def wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout}s")
        time.sleep(0.05)


def test_sigkill_and_resume_gives_identical_losses(tmp_path, shard_dir):
    steps = {"steps": 30}  # long enough that the kill lands mid-run on an idle machine
    straight = tmp_path / "straight"
    run(single_cmd(write_config(tmp_path / "a.yaml", shard_dir, straight, train=steps)))

    resumed = tmp_path / "resumed"
    cfg = write_config(tmp_path / "b.yaml", shard_dir, resumed, train={**steps, "save_interval": 2})
    proc = subprocess.Popen(single_cmd(cfg), cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(resumed / "checkpoints" / "step_00000002" / "trainer_state.json")
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait()
    assert not (resumed / "DONE.json").exists()
    run(single_cmd(cfg))  # train.resume: auto
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(1, 31))  # one line per step: lines logged after the checkpoint were replaced
    assert a == b  # bit-identical per-step losses


def test_interrupted_save_is_never_resumed_from(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", shard_dir, out, train={"steps": 4, "save_interval": 2})
    run(single_cmd(cfg))
    ckpts = out / "checkpoints"
    # What a process killed mid-save leaves: the .tmp directory with DeepSpeed's files but no trainer_state.json.
    shutil.copytree(ckpts / "step_00000004", ckpts / "step_00000006.tmp")
    (ckpts / "step_00000006.tmp" / "trainer_state.json").unlink()
    proc = run(single_cmd(cfg, "train.steps=6"))
    assert "removing incomplete checkpoint" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000004" in proc.stderr
    assert not (ckpts / "step_00000006.tmp").exists()
    assert json.loads((ckpts / "step_00000006" / "trainer_state.json").read_text())["step"] == 6


def test_sigterm_saves_and_exits_cleanly(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "t.yaml", shard_dir, out, train={"steps": 200, "save_interval": 1000})
    proc = subprocess.Popen(
        single_cmd(cfg), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for(out / "metrics.jsonl")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by signal" in output
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").exists()
    assert json.loads((saved[0] / "trainer_state.json").read_text())["step"] < 200


def test_nan_loss_stops_with_a_clear_message(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "n.yaml",
        shard_dir,
        out,
        optim={"lr": 1e30, "warmup_steps": 0},
        train={"steps": 30, "grad_clip": 0.0},
    )
    proc = subprocess.run(single_cmd(cfg), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "non-finite loss at step" in proc.stderr and "optim.lr" in proc.stderr


def test_nan_skip_gives_up_after_max_skips(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "s.yaml",
        shard_dir,
        out,
        optim={"lr": 1e30, "warmup_steps": 0},
        train={"steps": 40, "grad_clip": 0.0, "on_nan": "skip", "max_nan_skips": 2},
    )
    proc = subprocess.run(single_cmd(cfg), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "weights and optimizer state unchanged" in proc.stderr
    assert "3 steps in a row were skipped" in proc.stderr


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_on_a_different_number_of_ranks(tmp_path, shard_dir, stage):
    """2 ranks to step 3, then 1 rank to step 6 (same global batch and LR schedule) vs 2 ranks straight to step 6.

    ZeRO-2 goes through a universal checkpoint, which carries the Adam moments over: every later loss matches
    (1 vs 2 ranks is otherwise bit-identical here). ZeRO-3 restores exact weights (step 4's loss, computed before
    any update, matches exactly) and resets the moments, which the log says."""
    straight = tmp_path / "straight"
    run(launcher_cmd(write_config(tmp_path / "s.yaml", shard_dir, straight, deepspeed={"zero_stage": stage}), 2))
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "r.yaml", shard_dir, out, deepspeed={"zero_stage": stage})
    run(launcher_cmd(cfg, 2))  # the same 6-step LR schedule; checkpoints at steps 3 and 6
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # resume from step 3, now on one rank
    proc = run(single_cmd(cfg))
    assert "saved on 2" in proc.stderr
    state = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["world_size"] == 1 and state["data"]["consumed_samples"] == 6 * 8
    assert not list((out / "checkpoints").glob("*.tmp")) and not list((out / "checkpoints").glob("*universal*"))
    a, b = losses(straight), losses(out)
    assert sorted(b) == list(range(1, 7))
    assert a[4] == b[4]
    if stage == 2:
        assert "through a universal checkpoint" in proc.stderr
        for step in (5, 6):
            assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])
    else:
        assert "optimizer moments are reset" in proc.stderr


def test_two_node_hostfile_launch_over_loopback(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "h.yaml", shard_dir, out, train={"steps": 3, "save_interval": 3})
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                DEEPSPEED,
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(rank),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "--module",
                "tapetrain.train",
                str(cfg),
            ],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    assert sorted(losses(out)) == [1, 2, 3]
