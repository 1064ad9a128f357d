"""Context parallelism (ring attention, parallel.context_parallel) through real trainings on CPU ranks over gloo.

R = 2 on 2 ranks reproduces 1 rank with the same global batch (per-step losses, the validation loss and the final
weights, fp32, 1e-5) for all seven encodings without and with packed documents (short documents, so many span the
ranks' chunks), GQA (the tiny preset: 4 query heads, 2 KV heads) and MHA, ZeRO-2 and ZeRO-3, activation
checkpointing with the tiled MLP. A run killed with SIGKILL at R = 2 resumes at R = 1 on 1 rank with the same losses.
R = 2 × U = 2 (Ulysses inside, the ring across) on 4 ranks reproduces 1 rank for TAPE and RoPE.

Economy: the 1-rank references run in one process and all R = 2 cases in one 2-rank launch (run_cases_worker.py).
The op itself (every gradient against eager attention) is tested in tests/unit/test_ring_attention.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import env, losses, run, script_launcher_cmd, single_cmd, write_config
from test_document_mask_runs import short_docs  # noqa: F401 - the fixture: short documents
from test_resume_and_faults import wait_for
from test_sequence_parallel import REPO, WORKER, assert_same_run

pytestmark = pytest.mark.slow

STEPS = 3
KILL_STEPS = 12
RESUME_FROM = 6
PES = ("tape", "rope", "nope", "alibi", "xpos", "fire", "randpe")
CASES: dict[str, tuple[str, list[str]]] = {}  # name -> (config: "lm" | "docs", overrides)
for _pe in PES:
    CASES[_pe] = ("lm", [f"model.pe={_pe}"])
    CASES[f"{_pe}-docs-z3"] = ("docs", [f"model.pe={_pe}", "deepspeed.zero_stage=3"])
CASES.update({
    "tape-mha-docs": ("docs", ["model.pe=tape", "model.n_kv_heads=4"]),
    "rope-mha": ("lm", ["model.pe=rope", "model.n_kv_heads=4"]),
    "tape-ckpt-tiled": ("lm", ["model.pe=tape", "model.activation_checkpointing=true", "model.tiled_mlp=2"]),
    "kill-baseline": ("lm", ["model.pe=tape", f"train.steps={KILL_STEPS}", "train.save_interval=2", "data.val=[]",
                             "train.eval_interval=0"]),
})
# ZeRO-2: at 4 ranks ZeRO-3 drifts from 1 rank by ~1e-4 at step 2 with Ulysses alone (SP 4) as with the ring
FOUR_RANKS = ("tape-mha-docs", "rope")
CP2 = ["parallel.context_parallel=2"]


def configs(root: Path, shard_dir: Path, docs_dir: Path) -> dict[str, Path]:
    optim = {"eps": 1e-6}  # as test_sequence_parallel: no float noise scaled to steps of ~lr
    train = {"steps": STEPS, "save_interval": 0, "eval_interval": STEPS, "eval_steps": 1}
    return {
        "lm": write_config(root / "lm.yaml", shard_dir, root / "unused", optim=optim,
                           data={"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64}, train=train),
        "docs": write_config(root / "docs.yaml", docs_dir, root / "unused", optim=optim,
                             data={"train": str(docs_dir), "seq_len": 64, "document_mask": True},
                             train={**train, "eval_interval": 0}),
    }


def cases_file(path: Path, cfgs: dict[str, Path], out: Path, names, extra: list[str]) -> Path:
    cases = [{"config": str(cfgs[CASES[n][0]]), "overrides": [f"run.out_dir={out / n}", *CASES[n][1], *extra]}
             for n in names]
    path.write_text(json.dumps(cases))
    return path


def run_worker(cmd: list[str], timeout: int = 1500) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, shard_dir, short_docs):  # noqa: F811 - the imported fixture
    """Every case once on 1 rank (one process) and once at R = 2 on 2 ranks (one launch)."""
    root = tmp_path_factory.mktemp("cp")
    cfgs = configs(root, shard_dir, short_docs)
    run_worker([sys.executable, str(WORKER), str(cases_file(root / "one.json", cfgs, root / "one", CASES, []))])
    run_worker(script_launcher_cmd(WORKER, 2, str(cases_file(root / "two.json", cfgs, root / "two", CASES, CP2))))
    return root, cfgs


def test_a_ring_of_two_reproduces_one_rank(cp_runs):
    root, _ = cp_runs
    for name in CASES:
        assert_same_run(root / "one" / name, root / "two" / name, name)
    ds = json.loads((root / "two" / "tape" / "ds_config.json").read_text())
    assert ds["sequence_parallel_size"] == 2 and ds["gradient_accumulation_steps"] == 4  # 2 × 1 DP rank × 4 = 8
    state = json.loads((root / "two" / "tape" / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json")
                       .read_text())
    assert state["context_parallel"] == 2 and state["sequence_parallel"] == 1 and state["world_size"] == 2


def test_ring_of_two_by_ulysses_two_on_four_ranks_reproduces_one_rank(cp_runs):
    root, cfgs = cp_runs
    four = cases_file(root / "four.json", cfgs, root / "four", FOUR_RANKS, [*CP2, "parallel.sequence_parallel=2"])
    run_worker(script_launcher_cmd(WORKER, 4, str(four)))
    for name in FOUR_RANKS:
        assert_same_run(root / "one" / name, root / "four" / name, name)


def test_sigkill_at_a_ring_of_two_resumes_on_one_rank_with_the_same_losses(cp_runs, tmp_path):
    root, cfgs = cp_runs
    baseline = root / "one" / "kill-baseline"
    killed = tmp_path / "kill-baseline"
    cmd = script_launcher_cmd(WORKER, 2, str(cases_file(tmp_path / "k.json", cfgs, tmp_path, ["kill-baseline"],
                                                        CP2)))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(killed / "checkpoints" / f"step_{RESUME_FROM:08d}" / "trainer_state.json")
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no chance to clean up
    proc.wait()
    assert not (killed / "DONE.json").exists()
    log = run(single_cmd(cfgs["lm"], f"run.out_dir={killed}", *CASES["kill-baseline"][1])).stderr  # resume: auto
    assert "parallel.context_parallel=1 (saved with 2)" in log
    a, b = losses(baseline), losses(killed)
    assert sorted(b) == list(range(1, KILL_STEPS + 1))
    for step in range(1, KILL_STEPS + 1):
        assert abs(a[step] - b[step]) <= 1e-4, (step, a[step], b[step])
