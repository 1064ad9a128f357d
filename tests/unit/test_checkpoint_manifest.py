"""A checkpoint's manifest.json: what find_defect reports for each kind of damage (no training needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tapetrain.checkpoint import manifest


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory as a save leaves it: files, trainer_state.json, then the manifest."""
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 64)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "manifest": manifest.MANIFEST}))
    manifest.write_manifest(ckpt, manifest.describe(ckpt, manifest.checkpoint_files(ckpt)))
    return ckpt


def test_intact_checkpoint_has_no_defect(checkpoint):
    assert manifest.find_defect(checkpoint) is None
    listed = json.loads((checkpoint / manifest.MANIFEST).read_text())["files"]
    assert sorted(listed) == ["mp_rank_00_model_states.pt", "trainer_state.json"]
    assert listed["mp_rank_00_model_states.pt"]["bytes"] == 256 * 64


def test_each_kind_of_damage_names_the_file(checkpoint):
    model = checkpoint / "mp_rank_00_model_states.pt"
    raw = model.read_bytes()
    model.write_bytes(raw[:100])
    assert str(manifest.find_defect(checkpoint)) == (
        "damaged, step_00000002/mp_rank_00_model_states.pt has 100 bytes, the manifest lists 16384"
    )
    model.write_bytes(raw[:-1] + b"\x00")  # same size, one byte changed
    defect = manifest.find_defect(checkpoint)
    assert defect.kind == "damaged" and "mp_rank_00_model_states.pt has xxh3_64 checksum" in defect.detail
    model.unlink()
    assert manifest.find_defect(checkpoint).detail == "step_00000002/mp_rank_00_model_states.pt is missing"


def test_missing_trainer_state_is_incomplete_and_missing_manifest_is_damage(checkpoint):
    (checkpoint / manifest.MANIFEST).unlink()  # trainer_state.json says a manifest was written
    assert "manifest.json is missing" in manifest.find_defect(checkpoint).detail
    (checkpoint / "trainer_state.json").unlink()
    assert manifest.find_defect(checkpoint) is manifest.INCOMPLETE


def test_checkpoint_from_before_manifests_is_trusted_if_readable(checkpoint):
    (checkpoint / manifest.MANIFEST).unlink()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2}))
    assert manifest.find_defect(checkpoint) is None
    (checkpoint / "trainer_state.json").write_text('{"step": 2, "da')
    assert "trainer_state.json is unreadable" in manifest.find_defect(checkpoint).detail


def test_verify_checkpoints_of_a_run_directory(checkpoint):
    run_dir = checkpoint.parent.parent
    assert manifest.is_run_or_checkpoint(run_dir) and manifest.verify_checkpoints(run_dir) == ([], [])
    (checkpoint.parent / "step_00000004").mkdir()  # trainer_state.json never written
    problems, notes = manifest.verify_checkpoints(run_dir)
    assert problems == [f"step_00000004: {manifest.INCOMPLETE}"] and notes == []


# ---- completion off the training thread (tapetrain.checkpoint.completion) ----------------------------------------


def _two_rank_save(tmp_path: Path) -> tuple[Path, Path, list]:
    """A .tmp checkpoint completed by two 'ranks' (two PendingCheckpoints in this process, meeting through files)."""
    from tapetrain.checkpoint.completion import Completion

    tmp, final = tmp_path / "step_00000002.tmp", tmp_path / "step_00000002"
    tmp.mkdir()
    for i in range(4):
        (tmp / f"file{i}.pt").write_bytes(bytes([i]) * 1000)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": 2, "manifest": manifest.MANIFEST}))
    jobs = [Completion(tmp, 2, rank, 2, 5.0, (lambda: tmp.rename(final)) if rank == 0 else None) for rank in (0, 1)]
    return tmp, final, jobs


def test_completion_merges_every_rank_part_then_publishes(tmp_path):
    from tapetrain.checkpoint.completion import THREAD_NAME, PendingCheckpoint

    _, final, jobs = _two_rank_save(tmp_path)
    pending = [PendingCheckpoint(job) for job in reversed(jobs)]
    assert all(p.join() for p in pending)
    written = json.loads((final / manifest.MANIFEST).read_text())
    assert sorted(written["files"]) == ["file0.pt", "file1.pt", "file2.pt", "file3.pt", "trainer_state.json"]
    assert written["hashed_by"] == {"0": THREAD_NAME, "1": THREAD_NAME}
    assert manifest.find_defect(final) is None and not list(final.glob("manifest.rank*"))


def test_completion_failure_is_raised_at_join_and_leaves_the_tmp_directory(tmp_path, monkeypatch):
    from tapetrain.checkpoint.completion import PendingCheckpoint
    from tapetrain.errors import CheckpointError

    tmp, final, jobs = _two_rank_save(tmp_path)
    describe_strict = manifest.describe_strict

    def file_gone(checkpoint: Path, names: list[str]) -> dict:
        if "file1.pt" in names:  # rank 1's share: the file vanishes between listing and hashing
            (checkpoint / "file1.pt").unlink()
        return describe_strict(checkpoint, names)

    monkeypatch.setattr(manifest, "describe_strict", file_gone)
    pending = [PendingCheckpoint(job) for job in jobs]
    with pytest.raises(CheckpointError, match=r"step 2 could not be completed: rank 1 could not hash "
                                              r"step_00000002\.tmp/file1\.pt: \[Errno 2\]"):
        pending[0].join()  # rank 0 stops at rank 1's .failed part, not at its timeout
    with pytest.raises(CheckpointError, match="rank 1 could not hash"):
        pending[1].join()
    assert tmp.is_dir() and not final.exists()


def test_part_files_are_no_checkpoint_files(checkpoint):
    (checkpoint / "manifest.rank00001.json").write_text("{}")  # a stray part: neither listed nor checked
    assert "manifest.rank00001.json" not in manifest.checkpoint_files(checkpoint)
    assert manifest.find_defect(checkpoint) is None
