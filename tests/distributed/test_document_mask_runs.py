"""data.document_mask through real DeepSpeed training on short documents (many per 64-token window): 2 ranks
killed with SIGKILL resume with bit-identical per-step losses. (Sequence parallelism and the ring with the mask:
test_sequence_parallel.py's shared launches.)"""

import os
import signal
import subprocess
from pathlib import Path

import pytest
from harness import REPO, env, launcher_cmd, losses, run, write_config
from test_resume_and_faults import wait_for

pytestmark = pytest.mark.slow

STEPS = 8
MASK = {"document_mask": True}


def config(path: Path, data: Path, out: Path, **train) -> Path:
    return write_config(path, data, out, data=MASK, train={"steps": STEPS, **train})


def test_sigkill_and_resume_with_the_mask_is_bit_identical(short_docs, tmp_path):
    straight = tmp_path / "straight"
    log = run(launcher_cmd(config(tmp_path / "a.yaml", short_docs, straight), 2)).stderr
    assert "tokens per document" in log  # the startup line of the mask

    killed = tmp_path / "killed"
    cfg = config(tmp_path / "b.yaml", short_docs, killed, save_interval=2)
    proc = subprocess.Popen(
        launcher_cmd(cfg, 2),
        cwd=REPO,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for(killed / "checkpoints" / "step_00000002" / "trainer_state.json")
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no chance to clean up
    proc.wait()
    assert not (killed / "DONE.json").exists()
    run(launcher_cmd(cfg, 2))  # train.resume: auto
    a, b = losses(straight), losses(killed)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert a == b  # bit-identical per-step losses
