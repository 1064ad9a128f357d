"""A checkpoint's manifest is hashed off the training thread (issue 21), with real DeepSpeed on 2 ranks: the run's
checkpoints still all end complete with manifests, and a failure in the background surfaces on the training thread.

Before: every rank hashed its share inside save_checkpoint, so the training step waited for one full read of the
checkpoint.
"""

from __future__ import annotations

import json
import re

import pytest
from harness import REPO, attempt, script_launcher_cmd, write_config

from tapetrain.checkpoint import manifest, store
from tapetrain.checkpoint.completion import THREAD_NAME

pytestmark = pytest.mark.slow


def test_manifests_are_hashed_off_the_training_thread_and_complete_at_the_end(two_checkpoints):
    """The session's 2-rank, 4-step run with saves at steps 2 and 4 (tests/distributed/conftest.py)."""
    out = two_checkpoints
    log = (out.parent / "launch.log").read_text()
    checkpoints = store.complete_checkpoints(out)
    assert [step for step, _ in checkpoints] == [2, 4]
    for _, checkpoint in checkpoints:
        written = json.loads((checkpoint / manifest.MANIFEST).read_text())
        assert written["hashed_by"] == {"0": THREAD_NAME, "1": THREAD_NAME}  # not MainThread, on both ranks
        assert manifest.find_defect(checkpoint) is None
        assert not [p.name for p in checkpoint.iterdir() if manifest.PART.match(p.name)]  # merged, then removed
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert (out / "DONE.json").is_file()
    # the training thread went on before the hashing ended; the last save was waited for before DONE.json
    assert log.index("hashing them for the manifest in the background") < log.index("off the training thread")
    assert log.rindex("saved checkpoint") < log.index("done: ")


def test_a_failure_while_hashing_stops_the_run_at_the_next_wait(tmp_path, small_shard_dir):
    """Rank 1's thread finds a file of the last checkpoint gone: the run stops at the end-of-run wait with the file
    named, no DONE.json, and the checkpoint stays .tmp (a resume uses the one before)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", small_shard_dir, out, train={"steps": 4, "save_interval": 2})
    proc = attempt(script_launcher_cmd(REPO / "tests/distributed/vanishing_file_worker.py", 2, str(cfg), "4"))
    assert proc.returncode != 0, proc.stdout[-4000:]
    removed = re.search(r"removed step_00000004\.tmp/(\S+) before hashing it", proc.stdout)
    assert removed, proc.stdout[-4000:]
    message = (f"the checkpoint of step 4 could not be completed: rank 1 could not hash "
               f"step_00000004.tmp/{removed.group(1)}: [Errno 2] No such file or directory")
    assert message in proc.stdout, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout
    assert not (out / "DONE.json").exists()
    assert (out / "checkpoints" / "step_00000004.tmp").is_dir()
    assert store.find_checkpoint(out) == out / "checkpoints" / "step_00000002"
    assert manifest.find_defect(store.find_checkpoint(out)) is None
    assert store.step_directories(out) == [(2, out / "checkpoints" / "step_00000002")]
