"""Damaged checkpoints (issue 21, cases 1, 2 and 4), with real DeepSpeed: one 2-rank ZeRO-2 run saves two
checkpoints (the session's `two_checkpoints`, tests/distributed/conftest.py), then copies of it are damaged in several
ways.

Before the fix: a truncated model or optimizer file or trainer_state.json stopped with the loader's own error
(tracebacks on every rank under the launcher) and a flipped byte trained on silently; a failing load had already
rewritten config.yaml and added a config_history/ entry; a deleted trainer_state.json silently resumed from the
previous checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import attempt, files, launcher_cmd, run, single_cmd, write_config

from tapetrain.cli import main as cli_main

pytestmark = pytest.mark.slow

NEWEST, OLDER = "step_00000004", "step_00000002"
MODEL, OPTIM_1 = "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def copy_run(source: Path, data: Path, tmp_path: Path, name: str = "run", **train) -> tuple[Path, Path]:
    out = tmp_path / name
    shutil.copytree(source, out)
    cfg = write_config(tmp_path / f"{name}.yaml", data, out, train={"steps": 4, "save_interval": 2, **train})
    return cfg, out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 200] ^= 0x01  # inside tensor data: torch.load reads it without complaint
    path.write_bytes(bytes(raw))


def as_before_manifests(checkpoint: Path) -> None:
    """What a tapetrain from before checkpoint manifests wrote: no manifest.json, no mention of it."""
    (checkpoint / "manifest.json").unlink()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state.pop("manifest")
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


DAMAGE: dict[str, tuple[str, Callable[[Path], None]]] = {
    "model states truncated": (MODEL, truncate),
    "rank 1 optimizer truncated": (OPTIM_1, truncate),
    "trainer_state.json truncated": ("trainer_state.json", truncate),
    "one flipped byte": (OPTIM_1, flip_byte),
}


def test_damaged_newest_checkpoint_refuses_without_fallback(two_checkpoints, small_shard_dir, tmp_path):
    """train.resume_fallback=false: one line naming the damaged file and the fix, nothing written, every rank."""
    for i, (case, (name, damage)) in enumerate(DAMAGE.items()):
        cfg, out = copy_run(two_checkpoints, small_shard_dir, tmp_path, name=f"run{i}")
        damage(out / "checkpoints" / NEWEST / name)
        before = files(out)
        ranks = 2 if i == 0 else 1  # one start under the launcher: every rank stops, one says why
        cmd = (
            launcher_cmd(cfg, 2, "train.resume_fallback=false")
            if ranks == 2
            else single_cmd(cfg, "train.resume_fallback=false")
        )
        proc = attempt(cmd)
        assert proc.returncode == 1, (case, proc.stdout[-3000:])
        assert f"{NEWEST}/{name}" in proc.stdout and "damaged" in proc.stdout, (case, proc.stdout[-3000:])
        assert f"checkpoints/{OLDER}" in proc.stdout and "train.resume_fallback" in proc.stdout, case  # the fix
        assert "Traceback" not in proc.stdout, (case, proc.stdout[-3000:])
        assert proc.stdout.count("error") <= 2, (case, proc.stdout[-3000:])  # one message (+ the launcher's exit)
        assert files(out) == before, case


def test_damaged_newest_checkpoint_is_skipped_by_name(two_checkpoints, small_shard_dir, tmp_path):
    """The default falls back to the newest intact checkpoint and says which one it skipped and why; a checkpoint
    written before manifests existed still resumes (the log says it is unverified)."""
    cfg, out = copy_run(two_checkpoints, small_shard_dir, tmp_path)
    flip_byte(out / "checkpoints" / NEWEST / OPTIM_1)
    as_before_manifests(out / "checkpoints" / OLDER)
    proc = run(launcher_cmd(cfg, 2))
    log = proc.stdout + proc.stderr
    skipped = f"skipping checkpoint {out / 'checkpoints' / NEWEST}: damaged, {NEWEST}/{OPTIM_1} has xxh3_64 checksum"
    assert skipped in log, log[-4000:]
    assert f"{OLDER} has no manifest.json" in log
    assert f"resumed from {out / 'checkpoints' / OLDER} at step 2" in log
    assert (out / "checkpoints" / f"{NEWEST}.damaged" / OPTIM_1).is_file()  # set aside after the load, kept
    assert cli_main(["data", "verify", str(out)]) == 0  # the re-saved step 4 is intact again


def test_failed_load_leaves_the_run_directory_unchanged(two_checkpoints, small_shard_dir, tmp_path):
    """A checkpoint the manifest cannot vouch for (none: an older tapetrain) that fails to load on one rank: the
    start stops with one line and config.yaml / config_history/ are byte-identical (they were rewritten first)."""
    cfg, out = copy_run(two_checkpoints, small_shard_dir, tmp_path, steps=6)
    newest = out / "checkpoints" / NEWEST
    as_before_manifests(newest)
    truncate(newest / OPTIM_1)
    before = files(out)
    proc = attempt(launcher_cmd(cfg, 2))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert f"could not load {newest}" in proc.stdout and OPTIM_1 in proc.stdout, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-4000:]
    assert files(out) == before
    assert sorted(p.name for p in (out / "config_history").iterdir()) == ["start_001_from_step_00000000.yaml"]


def test_missing_trainer_state_is_reported(two_checkpoints, small_shard_dir, tmp_path):
    """A step directory without trainer_state.json used to be passed over in silence."""
    cfg, out = copy_run(two_checkpoints, small_shard_dir, tmp_path)
    (out / "checkpoints" / NEWEST / "trainer_state.json").unlink()
    proc = attempt(single_cmd(cfg, "--dry-run"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"skipping checkpoint {out / 'checkpoints' / NEWEST}: incomplete, no trainer_state.json" in proc.stdout
    assert f"resuming from {out / 'checkpoints' / OLDER}" in proc.stdout
    before = files(out)
    proc = attempt(launcher_cmd(cfg, 2, "train.resume_fallback=false"))
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert f"{NEWEST} is incomplete (no trainer_state.json" in proc.stdout, proc.stdout[-3000:]
    assert files(out) == before


def test_verify_command_checks_a_run_directory(two_checkpoints, small_shard_dir, tmp_path, capsys):
    """`tapetrain data verify RUN_DIR` checks every checkpoint against its manifest, as it checks shards."""
    assert cli_main(["data", "verify", str(two_checkpoints)]) == 0
    _, out = copy_run(two_checkpoints, small_shard_dir, tmp_path)
    truncate(out / "checkpoints" / OLDER / MODEL)
    capsys.readouterr()
    assert cli_main(["data", "verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{OLDER}/{MODEL}" in err and "bytes" in err
