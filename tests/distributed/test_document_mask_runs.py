"""data.document_mask through real DeepSpeed training on short documents (many per 64-token window): 2 ranks
killed with SIGKILL resume with bit-identical per-step losses, and sequence parallelism 2 (each rank a slice,
positions from the whole sequence's document starts) trains as one rank does."""

import json
import os
import signal
import subprocess
import sysconfig
from pathlib import Path

import pytest
from harness import REPO, env, launcher_cmd, losses, run, single_cmd, write_config
from test_resume_and_faults import wait_for

pytestmark = pytest.mark.slow

STEPS = 8
MASK = {"document_mask": True}


@pytest.fixture(scope="module")
def short_docs(shard_dir, tmp_path_factory):
    """Documents of 3 stdlib source lines (tens of tokens each), with shard_dir's tokenizer."""
    from tapetrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("short")
    lines = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text().splitlines()
    docs = ["\n".join(lines[i : i + 3]) for i in range(0, len(lines), 3) if "".join(lines[i : i + 3]).strip()]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(root / "corpus.jsonl")], str(shard_dir.parent / "tok.model"), str(root / "data"), progress=False)
    return root / "data"


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


def test_sequence_parallel_with_the_mask_trains_as_one_rank(short_docs, tmp_path):
    one, sp2 = tmp_path / "one", tmp_path / "sp2"
    run(single_cmd(config(tmp_path / "one.yaml", short_docs, one, steps=4)))
    run(launcher_cmd(config(tmp_path / "sp.yaml", short_docs, sp2, steps=4), 2, "parallel.sequence_parallel=2"))
    a, b = losses(one), losses(sp2)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
