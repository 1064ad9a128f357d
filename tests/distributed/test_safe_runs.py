"""Runs that cannot be silently corrupted: every case of the reliability issue, with real DeepSpeed (2 CPU ranks
over gloo through the `deepspeed` launcher, or one process where the case is a single process).

Each test failed before the fix it covers: resumes with another model trained on, changed optimizer settings were
ignored, failed starts rewrote config.yaml, two jobs shared a run directory, skipped steps still moved the weights,
SIGTERM to the launch script orphaned the ranks, a full disk gave tracebacks or a silent reset of Adam's moments.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from harness import (
    REPO,
    attempt,
    env,
    files,
    free_port,
    launcher_cmd,
    losses,
    run,
    script_launcher_cmd,
    single_cmd,
    write_config,
)

from tapetrain.config import load_run_config
from tapetrain.train.schedule import lr_at

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, small_shard_dir):
    """2 ranks, ZeRO-2, 3 steps of 8 sequences on a 40-sample dataset; one checkpoint, at step 3."""
    root = tmp_path_factory.mktemp("base")
    cfg = write_config(root / "base.yaml", small_shard_dir, root / "run", train={"steps": 3, "save_interval": 3})
    run(launcher_cmd(cfg, 2))
    return root / "run"


def copy_of(base_run: Path, data: Path, tmp_path: Path, **sections) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    sections["train"] = {"steps": 3, "save_interval": 3, **sections.get("train", {})}
    return write_config(tmp_path / "c.yaml", data, out, **sections), out


def test_resume_names_every_changed_data_setting(base_run, small_shard_dir, shard_dir, tmp_path):
    """Issue #40: switching what a step trains on at a resume (the document mask, seq_len, the mixture and its
    weights) was silent: the changed-settings line listed only train.steps. Now each is named, old -> new."""
    cfg, _ = copy_of(base_run, small_shard_dir, tmp_path)
    mixture = f"data.train=[{{path: {small_shard_dir}, weight: 1}}, {{path: {shard_dir}, weight: 3}}]"
    proc = run(launcher_cmd(cfg, 2, "train.steps=4", "data.document_mask=true", "data.seq_len=32", mixture))
    line = next(x for x in (proc.stdout + proc.stderr).splitlines() if "resuming with changed settings" in x)
    for change in ("data.document_mask: False -> True", "data.seq_len: 64 -> 32",
                   f"data.train: [{small_shard_dir} (weight 1.0)] -> [{small_shard_dir} (weight 1.0), {shard_dir} "
                   "(weight 3.0)]", "train.steps: 3 -> 4"):
        assert change in line, (change, line)


def test_resume_refuses_a_changed_model(base_run, small_shard_dir, tmp_path):
    """pe=rope or n_layers=1 used to train on (into the original run), n_layers=3 died in the universal conversion
    leaving a dangling latest_universal; same rank count: raw load_state_dict errors."""
    cfg, out = copy_of(base_run, small_shard_dir, tmp_path, train={"steps": 5})
    before = files(out)
    cases = [(single_cmd(cfg, "model.pe=rope"), "model.pe: checkpoint 'tape', config 'rope'"),
             (single_cmd(cfg, "model.n_layers=3"), "model.n_layers: checkpoint 2, config 3"),
             (launcher_cmd(cfg, 2, "model.n_layers=1"), "model.n_layers: checkpoint 2, config 1")]
    for cmd, expected in cases:
        proc = attempt(cmd)
        assert proc.returncode != 0, proc.stdout[-3000:]
        assert "cannot resume from" in proc.stdout and expected in proc.stdout, proc.stdout[-3000:]
        assert "run.out_dir" in proc.stdout and "model.init_from" in proc.stdout
        assert "Traceback" not in proc.stdout  # the message names the problem and the fix
        assert files(out) == before  # nothing written: no config.yaml, checkpoint or latest_universal
    assert not list(out.rglob("*universal*"))


def test_failed_start_leaves_the_run_directory_as_it_was(base_run, small_shard_dir, other_tokenizer_dir, tmp_path):
    """A bad data.train used to rewrite config.yaml and ds_config.json before failing; tokenizer mismatches and
    corrupt shards used to train silently."""
    cfg, out = copy_of(base_run, small_shard_dir, tmp_path)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(small_shard_dir, corrupt)
    shard = corrupt / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0x01  # one flipped bit; the ids stay valid, so only the checksum can tell
    shard.write_bytes(bytes(raw))
    before = files(out)
    cases = [
        ([f"data.train={tmp_path / 'missing'}"], "does not exist"),
        ([f"data.train=[{small_shard_dir}, {other_tokenizer_dir}]"], "tokenized with different tokenizers"),
        ([f"data.tokenizer={tmp_path / 'tok.model'}"], f"data.tokenizer={tmp_path / 'tok.model'} does not exist"),
        ([f"data.train={corrupt}", "data.verify=true"], "data.verify: 1 problem(s)"),
    ]
    for overrides, expected in cases:
        proc = attempt(single_cmd(cfg, *overrides))
        assert proc.returncode == 1 and expected in proc.stdout, (overrides, proc.stdout[-3000:])
        assert "Traceback" not in proc.stdout
        assert files(out) == before, overrides
    assert "train-00000.bin: sha256" in proc.stdout


def test_resume_applies_changed_settings_and_says_so(base_run, small_shard_dir, tmp_path):
    """The LR schedule, AdamW hyperparameters and clipping came from the checkpoint; now the config wins from the
    resumed step on, the log lists what changed, the batch-size change and the epoch wrap are logged, and each
    start's config is kept."""
    cfg, out = copy_of(base_run, small_shard_dir, tmp_path)
    overrides = ["train.steps=5", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.schedule=linear",
                 "optim.betas=[0.8, 0.9]", "optim.weight_decay=0.05", "train.grad_clip=0.5",
                 "train.global_batch_size=16"]
    proc = run(launcher_cmd(cfg, 2, *overrides))
    log = proc.stdout + proc.stderr
    assert "resuming with changed settings, applied from step 4 on:" in log
    for change in ("optim.lr: 0.003 -> 0.001", "optim.schedule: 'cosine' -> 'linear'", "optim.min_lr: 0.0 -> 0.0001",
                   "optim.betas: [0.9, 0.95] -> [0.8, 0.9]", "optim.weight_decay: 0.1 -> 0.05",
                   "train.grad_clip: 1.0 -> 0.5", "train.steps: 3 -> 5"):
        assert change in log, change
    assert "train.global_batch_size changed on resume: 8 -> 16" in log
    assert "data: the run draws 56 samples by its last step but the training data holds 40" in log
    assert "data: all 40 training samples have been drawn by step 4; epoch 1 begins" in log
    new = load_run_config(str(cfg), overrides)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in metrics if "lr" in m}
    for step in (4, 5):  # the LR of update `step` is lr_at(step - 1) of the *new* config
        assert lrs[step] == pytest.approx(lr_at(step - 1, new.optim, 5), rel=1e-12), (step, lrs)
    optim_state = torch.load(out / "checkpoints" / "step_00000005" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             map_location="cpu", weights_only=False)["optimizer_state_dict"]
    groups = optim_state["base_optimizer_state"]["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.8, 0.9)] * 2
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0] and optim_state["clip_grad"] == 0.5
    assert sorted(p.name for p in (out / "config_history").iterdir()) == [
        "start_001_from_step_00000000.yaml", "start_002_from_step_00000003.yaml"]
    lr_of = {p.parent.name: yaml.safe_load(p.read_text())["optim"]["lr"] for p in out.glob("checkpoints/*/config.yaml")}
    assert lr_of == {"step_00000003": 0.003, "step_00000005": 0.001}  # what produced each checkpoint
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 0.001
    from tapetrain.checkpoint.run_loader import load_run_model

    assert load_run_model(str(out), step=3)[1]["run_config"]["optim"]["lr"] == 0.003  # export/eval read it too
    state = json.loads((out / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert state["data"]["consumed_samples"] == 3 * 8 + 2 * 16 and state["optim"]["lr"] == 0.001


def _ranks_of(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)
            if any(a.startswith("--local_rank") for a in p.cmdline())]


def test_second_job_is_refused_and_kill_of_the_launch_script_saves_and_ends(shard_dir, tmp_path):
    """Two jobs on one run.out_dir used to both run; SIGTERM to the launch script (the deepspeed runner it exec'd)
    killed only the runner and left the ranks training."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "l.yaml", shard_dir, out, train={"steps": 5000, "save_interval": 0})
    launch_env = {**env(), "NUM_GPUS": "2", "MASTER_PORT": str(free_port()),
                  "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = subprocess.Popen(["bash", str(REPO / "launch" / "single_node.sh"), str(cfg)], cwd=REPO, env=launch_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks: list[int] = []
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
            assert time.time() < deadline and script.poll() is None, "the job did not start training"
            time.sleep(0.2)
        ranks = _ranks_of(script.pid)
        assert len(ranks) == 2
        holder = json.loads((out / ".tapetrain.lock").read_text())
        assert holder["pid"] in ranks
        # One process is enough to be refused (and a second 2-rank job would spin-wait against the first on 2 cores).
        second = attempt(single_cmd(cfg), timeout=300)
        assert second.returncode == 1 and "Traceback" not in second.stdout
        assert f"is in use by another job (host {holder['host']}, pid {holder['pid']}" in second.stdout
        script.send_signal(signal.SIGTERM)  # `kill PID` of the launch script
        output, _ = script.communicate(timeout=300)
    finally:
        for pid in [script.pid, *ranks]:
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                os.kill(pid, signal.SIGKILL)
    assert script.returncode == 0, output[-3000:]
    assert "sending SIGTERM to the training ranks" in output and "stopped by signal" in output
    assert not [pid for pid in ranks if psutil.pid_exists(pid)]  # no orphan keeps training
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file()
    step = json.loads((saved[0] / "trainer_state.json").read_text())["step"]
    assert 0 < step < 5000 and sorted(losses(out)) == list(range(1, step + 1))  # one writer: no interleaving
    assert not (out / "DONE.json").exists()


def test_skipped_steps_leave_weights_and_optimizer_state_bit_identical(shard_dir, tmp_path):
    """on_nan only looked at the loss (a run with non-finite gradients trained on and wrote DONE.json), and
    on_nan=skip still ran AdamW on zero gradients. See step_guard_probe.py for the injected faults."""
    cfg = write_config(tmp_path / "p.yaml", shard_dir, tmp_path / "unused", train={"steps": 10})
    out = tmp_path / "probe"
    out.mkdir()
    run(script_launcher_cmd(Path(__file__).parent / "step_guard_probe.py", 2, str(cfg), str(out), "0,2,3"))
    for rank in (0, 1):
        results = json.loads((out / f"rank{rank}.json").read_text())
        for stage, record in results.items():
            where = f"rank {rank}, ZeRO-{stage}"
            for kind in ("grad", "loss", "loss_only"):
                case = record[kind]
                assert case["unchanged"] and case["skipped"] == 1, (where, kind, case)
                assert case["lr_next"] == case["lr_expected"], (where, kind)  # the LR follows the step counter
            assert record["grad"]["loss_finite"], where  # the case: finite loss, non-finite gradients
            assert record["normal_step_changes_weights"], where
            assert record["stop"] and "non-finite gradient norm" in record["stop"], where
            assert record["nan_weights"] and "the weights contain NaN/inf" in record["nan_weights"], where
            assert not record["done_json"] and record["checkpoints"] == [], where


def _small_disk(tmp_path: Path) -> Path | None:
    """A mount point where `unshare -rm` can mount a tmpfs of a given size, or None where it cannot."""
    mount = tmp_path / "disk"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0"', str(mount)],
                           capture_output=True) if shutil.which("unshare") else None
    return mount if probe is not None and probe.returncode == 0 else None


def on_small_disk(mount: Path, size: int, cmd: list[str], seed: Path | None, keep: Path) -> subprocess.CompletedProcess:
    """Run `cmd` with a `size`-byte tmpfs at `mount` (a private mount namespace, so only this command sees it),
    optionally copying `seed` to MOUNT/run first; what MOUNT/run holds afterwards is copied to `keep`."""
    script = ('mount -t tmpfs -o size="$1" tmpfs "$0" || exit 99; if [ -n "$2" ]; then cp -a "$2" "$0/run"; fi; '
              'keep="$3"; shift 4; "$@"; rc=$?; cp -a "$0/run" "$keep"; exit $rc')
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount), str(size), str(seed or ""), str(keep),
                           "--", *cmd], cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)


def test_full_disk_stops_with_a_clear_message(base_run, small_shard_dir, shard_dir, tmp_path):
    """A full disk gave tracebacks from every rank and never said so; resuming on another rank count with a
    full disk silently reset Adam's moments."""
    mount = _small_disk(tmp_path)
    if mount is None:
        pytest.skip("cannot mount a small tmpfs here (needs `unshare -rm` with user namespaces)")
    # 1. A fresh 2-rank run on a 9 MiB filesystem: the first checkpoint (~2.6 MB, estimated at 7.6 MiB with
    #    its margins) fits, the second does not.
    cfg = write_config(tmp_path / "d.yaml", shard_dir, mount / "run",
                       train={"steps": 4, "save_interval": 1, "keep_last": 0})
    proc = on_small_disk(mount, 9 << 20, launcher_cmd(cfg, 2), None, tmp_path / "after1")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"no space left for the checkpoint of step 2 in {mount / 'run'}: it needs about" in proc.stdout
    assert proc.stdout.count("no space left for the checkpoint") == 1 and "Traceback" not in proc.stdout
    saved = sorted(p.name for p in (tmp_path / "after1" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000001"]
    # 2. Resuming the 2-rank base run on 1 rank needs a universal conversion; with ~1.5 MiB free it is refused
    #    up front (it used to fail for lack of space and fall back to fresh Adam moments, exit 0).
    used = sum(p.stat().st_size for p in base_run.rglob("*") if p.is_file())
    cfg = write_config(tmp_path / "r.yaml", small_shard_dir, mount / "run", train={"steps": 5, "save_interval": 5})
    proc = on_small_disk(mount, used + (3 << 19), single_cmd(cfg), base_run, tmp_path / "after2")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "no space left for converting step_00000003 for 1 rank(s)" in proc.stdout
    assert "moments are reset" not in proc.stdout and "Traceback" not in proc.stdout
    assert files(tmp_path / "after2") == files(base_run)


def on_read_only(mount: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` with `mount` bind-mounted read-only over itself (a private mount namespace: root's writes fail
    with EROFS there, where permission bits would not stop them)."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 99; exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount), *cmd], cwd=REPO, env=env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


def test_read_only_run_dir_stops_with_one_line_naming_it(small_shard_dir, tmp_path):
    """A read-only run directory, or a new one under a read-only parent, gave an Errno 30 traceback from mkdir."""
    if _small_disk(tmp_path) is None:
        pytest.skip("cannot mount here (needs `unshare -rm` with user namespaces)")
    ro = tmp_path / "ro"
    (ro / "old_run").mkdir(parents=True)
    (ro / "old_run" / "notes.txt").write_text("mine")
    before = files(ro)
    for out, named in ((ro / "old_run", ro / "old_run"), (ro / "new" / "run", ro)):
        cfg = write_config(tmp_path / f"{out.name}.yaml", small_shard_dir, out, train={"steps": 2})
        for extra in ((), ("--dry-run",)):
            proc = on_read_only(ro, [*single_cmd(cfg), *extra])
            assert proc.returncode == 1, proc.stdout[-3000:]
            expected = f"run.out_dir {out}: cannot write in {named} (read-only file system)"
            assert expected in proc.stdout, proc.stdout[-3000:]
            assert "Traceback" not in proc.stdout
    assert files(ro) == before and sorted(p.name for p in ro.iterdir()) == ["old_run"]


def test_failed_rank_count_conversion_stops_instead_of_resetting_moments(base_run, small_shard_dir, tmp_path):
    cfg, out = copy_of(base_run, small_shard_dir, tmp_path, train={"steps": 5, "save_interval": 5})
    checkpoint = out / "checkpoints" / "step_00000003"
    # A damaged optimizer partition in a checkpoint from before manifests (with one, the resume refuses it before
    # converting: test_damaged_checkpoints.py): the converter itself must fail cleanly.
    (checkpoint / "manifest.json").unlink()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "manifest"}))
    broken = checkpoint / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    broken.write_bytes(broken.read_bytes()[:1000])
    before = files(out)
    proc = attempt(single_cmd(cfg))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "could not convert" in proc.stdout and "saved on 2 ranks) for 1 rank(s)" in proc.stdout
    assert "Resume on 2 ranks" in proc.stdout and "moments are reset" not in proc.stdout
    assert files(out) == before and not list(out.rglob("*universal*"))


def test_documented_logging_and_save_keys_work(shard_dir, tmp_path):
    """train.save_interval=0 died with ZeroDivisionError; logging.console_interval and logging.peak_tflops were
    never read (mfu was null on CPU and absent from TensorBoard); run.name was never shown."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = write_config(tmp_path / "k.yaml", shard_dir, out, run={"name": "keys-check"},
                       train={"steps": 4, "save_interval": 0, "log_interval": 2},
                       logging={"tensorboard": True, "console_interval": 1, "peak_tflops": 0.001})
    proc = run(single_cmd(cfg))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000004"]  # only the last
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4] and all(m["mfu"] > 0 for m in metrics)
    assert all(f"keys-check step {s}/4 |" in proc.stderr for s in (1, 2, 3, 4))  # every step on the console
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/mfu")] == [2, 4]
    assert json.loads((out / "DONE.json").read_text())["name"] == "keys-check"
