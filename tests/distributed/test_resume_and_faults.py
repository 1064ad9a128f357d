"""Exact resume after SIGKILL, interrupted saves, SIGTERM, NaN policy, resume on another rank count, hostfile launch."""

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from harness import (
    DEEPSPEED,
    REPO,
    env,
    free_port,
    launcher_cmd,
    losses,
    run,
    script_launcher_cmd,
    single_cmd,
    write_config,
)

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
    # Killed while hashing: every file and trainer_state.json, one rank's manifest part, no manifest.json yet.
    hashing = ckpts / "step_00000008.tmp"
    shutil.copytree(ckpts / "step_00000004", hashing)
    (hashing / "manifest.json").rename(hashing / "manifest.rank00000.json")
    proc = run(single_cmd(cfg, "train.steps=6"))
    assert "removing incomplete checkpoint" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000004" in proc.stderr
    assert not (ckpts / "step_00000006.tmp").exists() and not hashing.exists()
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


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, shard_dir) -> dict[int, Path]:
    """2 ranks straight to step 6 (checkpoints at steps 3 and 6) with ZeRO-2 and with ZeRO-3: one launch."""
    root = tmp_path_factory.mktemp("straight")
    cases = [{"config": str(write_config(root / f"z{stage}.yaml", shard_dir, root / f"z{stage}",
                                         deepspeed={"zero_stage": stage})), "overrides": []} for stage in (2, 3)]
    (root / "cases.json").write_text(json.dumps(cases))
    run(script_launcher_cmd(Path(__file__).with_name("run_cases_worker.py"), 2, str(root / "cases.json")))
    return {stage: root / f"z{stage}" for stage in (2, 3)}


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_on_a_different_number_of_ranks(tmp_path, shard_dir, stage, two_rank_runs):
    """2 ranks to step 3, then 1 rank to step 6 (same global batch and LR schedule) vs 2 ranks straight to step 6.

    Weights and Adam moments carry over (ZeRO-2 through a universal checkpoint, ZeRO-3 by re-partitioning the
    saved fp32 masters and moments): every later loss matches (1 vs 2 ranks is otherwise bit-identical here).
    ZeRO-3 used to reset the moments; a resume from zeroed moments shows that step 5 would then differ."""
    straight = two_rank_runs[stage]
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "r.yaml", shard_dir, out, deepspeed={"zero_stage": stage})
    # The run to resume is that same 2-rank run (6-step LR schedule, checkpoints at steps 3 and 6): a copy of it,
    # not a second identical launch.
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # resume from step 3, now on one rank
    if stage == 3:
        reset = tmp_path / "reset"
        shutil.copytree(out, reset)
        zero_adam_moments(reset / "checkpoints" / "step_00000003")
    proc = run(single_cmd(cfg))
    assert "saved on 2" in proc.stderr and "moments are reset" not in proc.stderr
    assert "weights, optimizer moments, LR schedule, step and data position are restored" in proc.stderr
    state = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["world_size"] == 1 and state["data"]["consumed_samples"] == 6 * 8
    assert not list((out / "checkpoints").glob("*.tmp")) and not list((out / "checkpoints").glob("*universal*"))
    a, b = losses(straight), losses(out)
    assert sorted(b) == list(range(1, 7))
    assert a[4] == b[4]
    for step in (5, 6):
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])
    if stage == 3:  # the tolerance can tell restored moments from reset ones
        run(single_cmd(write_config(tmp_path / "z.yaml", shard_dir, reset, deepspeed={"zero_stage": stage})))
        assert abs(losses(reset)[5] - a[5]) > 1e-3, (losses(reset)[5], a[5])


def zero_adam_moments(checkpoint: Path) -> None:
    """Zero Adam's moments in every rank's ZeRO-3 optimizer file (what a moments-reset resume starts from), and
    record the edited files in the checkpoint's manifest, else the resume rightly refuses them as damaged."""
    import torch

    from tapetrain.checkpoint import manifest

    for path in checkpoint.glob("*_optim_states.pt"):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        for state in saved["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        torch.save(saved, path)
    manifest.write_manifest(checkpoint, manifest.describe(checkpoint, manifest.checkpoint_files(checkpoint)))


def test_a_stopped_rank_ends_the_job_naming_the_step_and_the_rank(tmp_path, shard_dir):
    """A SIGSTOPped rank left the others blocked for 30 minutes without a word, whatever deepspeed.timeout_minutes
    said (the groups DeepSpeed creates kept torch's default timeout). Now the job ends within the timeout and
    rank 0 names the step and the rank that did not arrive."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "h.yaml", shard_dir, out, train={"steps": 5000, "save_interval": 0},
                       deepspeed={"timeout_minutes": 0.2})
    job = subprocess.Popen(launcher_cmd(cfg, 2), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stopped = None
    try:
        deadline = time.time() + 300
        while len(losses_so_far(out)) < 2:
            assert time.time() < deadline and job.poll() is None, "the job did not start training"
            time.sleep(0.2)
        stopped = rank_process(job.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        since, elapsed, lines = time.time(), None, []
        for line in job.stdout:  # the launcher's SIGTERM cannot reach a stopped rank: it waits 30 s, then kills
            lines.append(line)
            if "did not arrive" in line:
                elapsed = time.time() - since
                os.kill(stopped, signal.SIGKILL)  # what the launcher does 30 s later
                break
        output = "".join(lines) + job.communicate(timeout=150)[0]
    finally:
        if stopped is not None and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    found = re.search(r"step (\d+): rank\(s\) 1 did not arrive", output)
    assert job.returncode != 0 and found and elapsed < 90, (elapsed, output[-3000:])
    assert int(found.group(1)) >= max(losses_so_far(out)), output[-3000:]
    assert "deepspeed.timeout_minutes=0.2" in output and "last heartbeat" in output


def test_a_killed_rank_is_named_as_dead_with_its_last_step(tmp_path, shard_dir):
    """Issue #40: SIGKILL of rank 1 of a sequence-parallel run: the survivor said rank 1 "did not arrive at a
    collective within deepspeed.timeout_minutes=30" with a heartbeat steps behind. Now the dead rank is named as
    dead (its process gone, its connection closed) at once, with the step it was on."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "k.yaml", shard_dir, out, train={"steps": 5000, "save_interval": 0},
                       parallel={"sequence_parallel": 2}, deepspeed={"timeout_minutes": 0.5})
    job = subprocess.Popen(launcher_cmd(cfg, 2), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while len(losses_so_far(out)) < 3:
            assert time.time() < deadline and job.poll() is None, "the job did not start training"
            time.sleep(0.05)
        os.kill(rank_process(job.pid, 1), signal.SIGKILL)
        since = time.time()
        output, _ = job.communicate(timeout=150)
        elapsed = time.time() - since
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and elapsed < 25, (elapsed, output[-3000:])  # well within the 30 s timeout
    assert "did not arrive" not in output, output[-3000:]
    found = re.search(r"step (\d+): rank\(s\) 1 died \(rank 1: process (\d+) on \S+ is gone.*?working on step (\d+)",
                      output)
    assert found, output[-3000:]
    step, beat_step = int(found.group(1)), int(found.group(3))
    assert step >= max(losses_so_far(out)) and beat_step >= step - 1, found.group(0)


def test_ranks_whose_launcher_is_gone_save_and_exit(tmp_path, small_shard_dir):
    """Issue #46: SIGTERM to the `deepspeed` runner ends it at once (it forwards no signal), and its per-node launch
    process and the ranks trained on, unsupervised, to the last step. Now every rank sees within seconds that its
    launcher is gone and stops as on SIGTERM: a checkpoint at the end of the step, one message, exit."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "g.yaml", small_shard_dir, out, train={"steps": 5000, "save_interval": 0})
    job = subprocess.Popen(launcher_cmd(cfg, 2), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)  # EOF: every writer exited
    reader.start()
    try:
        deadline = time.time() + 300
        while not losses_so_far(out):
            assert time.time() < deadline and job.poll() is None, "the job did not start training"
            time.sleep(0.2)
        ranks = [psutil.Process(rank_process(job.pid, rank)) for rank in (0, 1)]
        launch = psutil.Process(ranks[0].ppid())
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == -signal.SIGTERM  # the runner is gone at once; its ranks are not
        since = time.time()
        _, alive = psutil.wait_procs([*ranks, launch], timeout=90)
        elapsed = time.time() - since
        reader.join(timeout=30)
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # the launch process and the ranks share the runner's group
        except ProcessLookupError:
            pass
    output = "".join(lines)
    assert not alive, f"still running {elapsed:.0f} s after the runner ended: {alive}\n{output[-3000:]}"
    notice = f"the launcher of this rank is gone: the `deepspeed` runner (pid {job.pid}) has ended"
    assert output.count(notice) == 1, output[-3000:]  # one rank of the node says so
    found = re.search(r"stopped by its launcher's end at step (\d+); checkpoint saved. To resume, start the same "
                      r"command again \(train.resume=auto", output)
    assert found, output[-3000:]
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{int(found.group(1)):08d}"], saved  # complete: renamed from .tmp
    assert (saved[0] / "manifest.json").is_file() and not (out / "DONE.json").exists()
    assert json.loads((saved[0] / "trainer_state.json").read_text())["step"] == max(losses(out)) < 5000


def losses_so_far(run_dir: Path) -> dict[int, float]:
    """The complete lines of a metrics.jsonl that is still being written."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def rank_process(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's training rank `rank` (started with --local_rank=RANK)."""
    children = psutil.Process(launcher_pid).children(recursive=True)
    return next(p.pid for p in children if f"--local_rank={rank}" in p.cmdline())


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
