"""Supervised examples (tapetrain data arith) through real DeepSpeed training, tested as the LM reader is: the same
per-step losses on 1 and 2 ranks, bit-identical losses after SIGKILL + resume, and resume on another rank count.
The model adds Abacus digit places (model.abacus), so the same checks hold its random training offsets: keyed on
the samples' slots in the data order, they are the same on 1 and 2 ranks and after a resume."""

import shutil
import signal
import subprocess

import pytest
from harness import REPO, env, launcher_cmd, losses, run, single_cmd, write_config
from test_resume_and_faults import wait_for

from tapetrain.data.arith import VOCAB_SIZE, write_arith_data

pytestmark = pytest.mark.slow

STEPS = 30


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "data"
    write_arith_data(str(out), max_digits=3, eval_max_digits=4, train_examples=3000, eval_per_cell=5, progress=False)
    return out


def config(path, data, out, **train):
    """A tiny TAPE model with Abacus on 3-digit additions (examples up to 14 tokens), ZeRO-2, answer-only loss."""
    return write_config(path, data, out, model={"vocab_size": VOCAB_SIZE, "max_seq_len": 16, "abacus": True},
                        data={"seq_len": 13}, train={"steps": STEPS, "save_interval": 15, **train})


@pytest.fixture(scope="module")
def two_rank_run(arith_dir, tmp_path_factory):
    """The uninterrupted 2-rank run's directory (checkpoints at steps 15 and 30); tests copy it, never change it."""
    two = tmp_path_factory.mktemp("refs") / "two"
    run(launcher_cmd(config(two.parent / "two.yaml", arith_dir, two), 2))
    return two


@pytest.fixture(scope="module")
def references(arith_dir, two_rank_run, tmp_path_factory):
    """Uninterrupted runs: 2 ranks and 1 rank, same global batch (8) and micro batch (2)."""
    one = tmp_path_factory.mktemp("refs") / "one"
    run(single_cmd(config(one.parent / "one.yaml", arith_dir, one)))
    return losses(two_rank_run), losses(one)


def test_examples_train_the_same_on_one_and_two_ranks(references):
    two, one = references
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in two:
        assert abs(two[step] - one[step]) < 1e-5, (step, two[step], one[step])
    assert one[STEPS] < one[1] - 0.3  # the answer-only loss goes down (from about ln 16 = 2.77)


def test_sigkill_and_resume_gives_identical_losses(arith_dir, references, tmp_path):
    _, one = references
    out = tmp_path / "killed"
    cfg = config(tmp_path / "k.yaml", arith_dir, out, save_interval=2)
    proc = subprocess.Popen(single_cmd(cfg), cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(out / "checkpoints" / "step_00000002" / "trainer_state.json")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "DONE.json").exists()
    run(single_cmd(cfg))  # train.resume: auto
    assert losses(out) == one  # bit-identical per-step losses, every step logged once


def test_resume_on_a_different_number_of_ranks(arith_dir, references, two_rank_run, tmp_path):
    two, _ = references
    out = tmp_path / "run"
    cfg = config(tmp_path / "r.yaml", arith_dir, out)
    shutil.copytree(two_rank_run, out)  # that 2-rank run (checkpoints at steps 15 and 30), not a second launch of it
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    proc = run(single_cmd(cfg))  # resume from step 15 on one rank (universal checkpoint for ZeRO-2)
    assert "saved on 2" in proc.stderr
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed[16] == two[16]  # computed from the restored weights before any update on one rank
    for step in range(17, STEPS + 1):
        assert abs(resumed[step] - two[step]) < 1e-4, (step, resumed[step], two[step])
