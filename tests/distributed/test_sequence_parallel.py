"""Sequence parallelism (DeepSpeed-Ulysses) and context parallelism (the ring) through real trainings on CPU ranks
over gloo, each against one rank with the same global batch: per-step losses, the validation loss and the final
weights (fp32, 1e-5).

Ulysses, parallel.sequence_parallel=2 on 2 ranks: every positional encoding with ZeRO-2 and ZeRO-3; MQA (keys and
values expanded before the exchange), the supervised (answer-only) path, activation checkpointing with a random
position offset, the Triton kernel (TRITON_INTERPRET=1), the tiled MLP (ZeRO-2 and ZeRO-3, against the untiled
run; 1 rank tiled too) and packed documents (positions from the whole sequence's document starts).

The ring, parallel.context_parallel=2 on 2 ranks: all seven encodings without and with packed documents (short
documents, so many span the ranks' chunks; ZeRO-3), GQA (the tiny preset: 4 query heads, 2 KV heads) and MHA,
activation checkpointing with the tiled MLP.

On 4 ranks: DP 2 × SP 2, and the ring of 2 × Ulysses 2 (Ulysses inside, the ring across). A run killed with
SIGKILL at SP 2 resumes with bit-identical losses, and one resumed at SP 1 on 1 rank continues the same losses; one
killed at a ring of 2 resumes at R = 1 on 1 rank with the same losses.

Economy: every 1-rank reference runs in one process, every 2-rank run in one launch and every 4-rank run in one
launch (run_cases_worker.py): imports, the launch and DeepSpeed's first engine are paid once per launch, not once
per case; a 2-rank run of the ring and one of Ulysses compare against the same reference. The ring op itself
(every gradient against eager attention) is tested in tests/unit/test_ring_attention.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, env, losses, run, script_launcher_cmd, single_cmd, write_config
from test_resume_and_faults import wait_for

from tapetrain.data.arith import VOCAB_SIZE, write_arith_data

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("run_cases_worker.py")
STEPS = 5
KILL_STEPS = 16  # long enough that the kill (after step 2) lands mid-run
RESUME_FROM = 10  # the step whose checkpoint resumes with another layout
TOL = 1e-5
SP2 = ["parallel.sequence_parallel=2"]
CP2 = ["parallel.context_parallel=2"]
TILED = "model.tiled_mlp=3"  # 32 tokens per rank at SP 2: chunks of 11, 11 and 10

PES = ("tape", "rope", "nope", "alibi", "xpos", "fire", "randpe")
# The 1-rank references: name -> (config, overrides). A tiny model (4 query heads, 2 KV heads: GQA), seq 64.
CASES: dict[str, tuple[str, list[str]]] = {}
for _pe in PES:
    for _stage in (2, 3):
        CASES[f"{_pe}-z{_stage}"] = ("lm", [f"model.pe={_pe}", f"deepspeed.zero_stage={_stage}"])
    CASES[f"{_pe}-docs-z3"] = ("docs", [f"model.pe={_pe}", "deepspeed.zero_stage=3"])
CASES.update({
    # one KV head, fewer than the 2 ranks: keys and values are expanded to the query heads before the exchange;
    # the eager backend inside
    "tape-mqa": ("lm", ["model.pe=tape", "model.n_kv_heads=1"]),
    "rope-mqa-eager": ("lm", ["model.pe=rope", "model.n_kv_heads=1", "model.attn_backend=eager"]),
    # xPos's decay in several query blocks, FIRE shared by the layers, one RandPE draw for all layers, ZeRO-1
    "xpos-blocks-z1": ("lm", ["model.pe=xpos", "model.xpos_scale_base=16", "deepspeed.zero_stage=1"]),
    "fire-shared": ("lm", ["model.pe=fire", "model.fire_shared=true"]),
    "randpe-one-draw": ("lm", ["model.pe=randpe", "model.randpe_per_layer=false"]),
    "tape-ckpt-offset": ("lm", ["model.pe=tape", "model.activation_checkpointing=true",
                                "train.random_position_offset=100", "model.loss_backend=plain"]),
    "tape-triton": ("lm", ["model.pe=tape", "model.attn_backend=triton", "data.seq_len=32", "train.steps=2",
                           "train.global_batch_size=4", "data.val=[]", "train.eval_interval=0"]),
    "tape-supervised": ("examples", ["model.pe=tape"]),  # arith examples: answer-only labels
    "tape-mha-docs": ("docs", ["model.pe=tape", "model.n_kv_heads=4"]),
    "rope-mha": ("lm", ["model.pe=rope", "model.n_kv_heads=4"]),
    "tape-ckpt-tiled": ("lm", ["model.pe=tape", "model.activation_checkpointing=true", "model.tiled_mlp=2"]),
    "kill-baseline": ("lm", ["model.pe=tape", f"train.steps={KILL_STEPS}", "train.save_interval=2", "data.val=[]",
                             "train.eval_interval=0"]),
})
ULYSSES_CASES = [n for n in CASES if "-docs" not in n and n not in ("tape-mha-docs", "rope-mha", "tape-ckpt-tiled")]
# Other runs: name -> (reference case, extra overrides, ranks): the reference's config and overrides, then these
OTHER_RUNS: dict[str, tuple[str, list[str], int]] = {
    "tape-tiled-z2": ("tape-z2", [TILED], 1),
    **{f"tape-tiled-z{z}-sp2": (f"tape-z{z}", [TILED, *SP2], 2) for z in (2, 3)},
    **{f"{n}-sp2": (n, SP2, 2) for n in ("tape-docs-z3", "tape-mha-docs")},
    **{f"{pe}-z2-ring": (f"{pe}-z2", CP2, 2) for pe in PES},
    **{f"{n}-ring": (n, CP2, 2) for n in (*(f"{pe}-docs-z3" for pe in PES), "tape-mha-docs", "rope-mha",
                                           "tape-ckpt-tiled")},
    # DP 2 × SP 2. Not RandPE: its draws come from each data-parallel rank's random stream, so under data
    # parallelism (with or without SP) a sequence's draw depends on which rank reads it.
    **{f"{n}-dp2-sp2": (n, SP2, 4) for n in ("tape-z2", "alibi-z3", "fire-z2")},
    # the ring of 2 × Ulysses 2; ZeRO-2: at 4 ranks ZeRO-3 drifts from 1 rank by ~1e-4 at step 2 with Ulysses
    # alone (SP 4) as with the ring
    **{f"{n}-ring2-sp2": (n, [*CP2, *SP2], 4) for n in ("tape-mha-docs", "rope-z2")},
}
OTHER_RUNS.update({f"{n}-sp2": (n, SP2, 2) for n in ULYSSES_CASES})


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "data"
    write_arith_data(str(out), max_digits=3, eval_max_digits=4, train_examples=600, eval_per_cell=5, progress=False)
    return out


def base_config(root: Path, shard_dir: Path, arith_dir: Path, docs_dir: Path) -> dict[str, Path]:
    # Adam's eps at 1e-6 (not 1e-8): a few parameters have a gradient that is zero up to float noise (FIRE's output
    # bias, a constant per head under the softmax) and Adam would scale that noise, whose sign no reordering of
    # sums reproduces, to steps of ~lr. Real gradients here are far above 1e-6.
    optim = {"eps": 1e-6}
    train = {"steps": STEPS, "save_interval": 0, "eval_interval": STEPS, "eval_steps": 1}
    lm = write_config(root / "lm.yaml", shard_dir, root / "unused", optim=optim,
                      data={"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64}, train=train)
    # 3 steps with documents: TAPE's final weights at ZeRO-3 drift 4e-5 from 1 rank by step 5 (losses do not)
    docs = write_config(root / "docs.yaml", docs_dir, root / "unused", optim=optim,
                        data={"train": str(docs_dir), "seq_len": 64, "document_mask": True},
                        train={**train, "steps": 3, "eval_interval": 0})
    examples = write_config(root / "examples.yaml", arith_dir, root / "unused", optim=optim,
                            model={"vocab_size": VOCAB_SIZE, "max_seq_len": 16}, data={"seq_len": 14},
                            train={"steps": STEPS, "save_interval": 0})
    return {"lm": lm, "docs": docs, "examples": examples}


def case(configs: dict[str, Path], out: Path, name: str) -> dict:
    """A run_cases_worker.py case: a reference (CASES) or another run (OTHER_RUNS), into out/name."""
    reference, extra, _ = OTHER_RUNS.get(name, (name, [], 1))
    config, overrides = CASES[reference]
    return {"config": str(configs[config]), "overrides": [f"run.out_dir={out / name}", *overrides, *extra]}


def cases_file(path: Path, configs: dict[str, Path], out: Path, names, extra: tuple[str, ...] = ()) -> Path:
    cases = [case(configs, out, name) for name in names]
    for c in cases:
        c["overrides"] += extra
    path.write_text(json.dumps(cases))
    return path


def run_worker(cmd: list[str]) -> None:
    run(cmd, timeout=1500, extra_env={"TRITON_INTERPRET": "1"})  # the Triton kernel on CPU (tape-triton)


def runs_on(ranks: int) -> list[str]:
    return [name for name, (_, _, n) in OTHER_RUNS.items() if n == ranks]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, shard_dir, arith_dir, short_docs):
    """Every reference and 1-rank run in one process, every 2-rank run in one launch (root/NAME)."""
    root = tmp_path_factory.mktemp("layouts")
    configs = base_config(root, shard_dir, arith_dir, short_docs)
    run_worker([sys.executable, str(WORKER), str(cases_file(root / "one.json", configs, root, [*CASES, *runs_on(1)]))])
    run_worker(script_launcher_cmd(WORKER, 2, str(cases_file(root / "two.json", configs, root, runs_on(2)))))
    return root, configs


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = json.loads((run_dir / "DONE.json").read_text())
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step_{state['step']:08d}")


def val_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def assert_same_run(reference: Path, other: Path, name: str) -> None:
    a, b = losses(reference), losses(other)
    assert sorted(a) == sorted(b) and len(a) >= 2, (name, a, b)
    for step in a:
        assert abs(a[step] - b[step]) <= TOL, (name, step, a[step], b[step])
    assert val_losses(reference).keys() == val_losses(other).keys()
    for step, value in val_losses(reference).items():
        assert abs(value - val_losses(other)[step]) <= TOL, (name, "val", step, value, val_losses(other)[step])
    wa, wb = final_weights(reference), final_weights(other)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= TOL, (name, "weights", worst)


def assert_runs_match_their_references(root: Path, names: list[str]) -> None:
    for name in names:
        assert_same_run(root / OTHER_RUNS[name][0], root / name, name)


def test_sp2_on_two_ranks_reproduces_one_rank(layout_runs):
    root, _ = layout_runs
    assert_runs_match_their_references(root, [n for n in runs_on(2) if n.endswith("-sp2")] + runs_on(1))
    ds = json.loads((root / "tape-z2-sp2" / "ds_config.json").read_text())
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == 4  # micro 2 × 1 data-parallel rank × 4 = global batch 8
    state = json.loads((root / "tape-z2-sp2" / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert state["sequence_parallel"] == 2 and state["world_size"] == 2 and state["tokens"] == STEPS * 8 * 64
    assert val_losses(root / "tape-z2"), "validation ran"
    assert "tiled_mlp: 3" in (root / "tape-tiled-z3-sp2" / "config.yaml").read_text()


def test_a_ring_of_two_reproduces_one_rank(layout_runs):
    root, _ = layout_runs
    ring = [n for n in runs_on(2) if n.endswith("-ring")]
    assert len(ring) == 2 * len(PES) + 3
    assert_runs_match_their_references(root, ring)
    ds = json.loads((root / "tape-z2-ring" / "ds_config.json").read_text())
    assert ds["sequence_parallel_size"] == 2 and ds["gradient_accumulation_steps"] == 4  # 2 × 1 DP rank × 4 = 8
    state = json.loads((root / "tape-z2-ring" / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json")
                       .read_text())
    assert state["context_parallel"] == 2 and state["sequence_parallel"] == 1 and state["world_size"] == 2


def test_dp2_sp2_and_a_ring_of_two_by_ulysses_two_on_four_ranks_reproduce_one_rank(layout_runs):
    """Two launches: a process keeps the sequence-parallel groups of its first layout."""
    root, configs = layout_runs
    for layout in ("-dp2-sp2", "-ring2-sp2"):
        names = [n for n in runs_on(4) if n.endswith(layout)]
        run_worker(script_launcher_cmd(WORKER, 4, str(cases_file(root / f"four{layout}.json", configs, root, names))))
    assert_runs_match_their_references(root, runs_on(4))
    ds = json.loads((root / "tape-z2-dp2-sp2" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2  # 2 × 2 data-parallel × 2


def copy_until(run_dir: Path, out: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after checkpoint `step`."""
    shutil.copytree(run_dir, out)
    for checkpoint in (out / "checkpoints").glob("step_*"):
        if int(checkpoint.name.split("_")[1]) > step:
            shutil.rmtree(checkpoint)
    (out / "DONE.json").unlink()
    return out


def kill_after(cmd: list[str], checkpoint: Path) -> None:
    """Start `cmd` (a launch), SIGKILL the launcher and its ranks once `checkpoint` is complete."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env({"TRITON_INTERPRET": "1"}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(checkpoint / "trainer_state.json")
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no chance to clean up
    proc.wait()


def test_sigkill_at_sp2_resumes_identically_and_sp_changes_on_resume(layout_runs, tmp_path):
    """Killed at SP 2 and resumed: bit-identical. A checkpoint resumed with another SP degree on another number of
    ranks (ZeRO-2 through DeepSpeed's universal checkpoint, weights and Adam moments) continues the same losses: SP 2
    on 2 ranks -> SP 1 on 1 rank, and SP 1 on 1 rank -> SP 2 on 2 ranks."""
    root, configs = layout_runs
    baseline = root / "kill-baseline-sp2"
    killed = tmp_path / "kill-baseline-sp2"
    k = cases_file(tmp_path / "k.json", configs, tmp_path, ["kill-baseline-sp2"])
    kill_after(script_launcher_cmd(WORKER, 2, str(k)), killed / "checkpoints" / "step_00000002")
    assert not (killed / "DONE.json").exists()

    to_sp2 = copy_until(root / "kill-baseline", tmp_path / "to-sp2" / "kill-baseline", RESUME_FROM)
    to_sp1 = copy_until(baseline, tmp_path / "to-sp1", RESUME_FROM)
    resume = json.loads(k.read_text())  # the killed run, then the SP 1 run at SP 2
    resume.append({**resume[0], "overrides": [f"run.out_dir={to_sp2}", *resume[0]["overrides"][1:]]})
    k.write_text(json.dumps(resume))
    run_worker(script_launcher_cmd(WORKER, 2, str(k)))  # train.resume: auto
    assert losses(killed) == losses(baseline)  # bit-identical per-step losses, every step logged once

    log = run(single_cmd(configs["lm"], f"run.out_dir={to_sp1}", *CASES["kill-baseline"][1])).stderr
    assert "through a universal checkpoint" in log and "parallel.sequence_parallel=1 (saved with 2)" in log
    for moved in (to_sp1, to_sp2):
        a, b = losses(baseline), losses(moved)
        assert sorted(b) == list(range(1, KILL_STEPS + 1))
        for step in range(RESUME_FROM + 1, KILL_STEPS + 1):
            assert abs(a[step] - b[step]) <= 1e-4, (moved.name, step, a[step], b[step])
    state = json.loads((to_sp2 / "checkpoints" / f"step_{KILL_STEPS:08d}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["sequence_parallel"] == 2


def test_sigkill_at_a_ring_of_two_resumes_on_one_rank_with_the_same_losses(layout_runs, tmp_path):
    root, configs = layout_runs
    killed = tmp_path / "kill-baseline"
    k = cases_file(tmp_path / "k.json", configs, tmp_path, ["kill-baseline"], tuple(CP2))
    kill_after(script_launcher_cmd(WORKER, 2, str(k)), killed / "checkpoints" / f"step_{RESUME_FROM:08d}")
    assert not (killed / "DONE.json").exists()
    log = run(single_cmd(configs["lm"], f"run.out_dir={killed}", *CASES["kill-baseline"][1])).stderr  # resume: auto
    assert "parallel.context_parallel=1 (saved with 2)" in log
    a, b = losses(root / "kill-baseline"), losses(killed)
    assert sorted(b) == list(range(1, KILL_STEPS + 1))
    for step in range(1, KILL_STEPS + 1):
        assert abs(a[step] - b[step]) <= 1e-4, (step, a[step], b[step])


def test_a_world_size_that_sp_does_not_divide_stops_before_writing(tmp_path, shard_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", shard_dir, out, parallel={"sequence_parallel": 2})
    proc = subprocess.run(single_cmd(cfg), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "parallel.sequence_parallel=2 does not divide the 1 rank(s) of this launch" in proc.stderr
    assert "launch a multiple of 2 ranks" in proc.stderr
    assert not out.exists()
