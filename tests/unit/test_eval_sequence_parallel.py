"""`eval ppl` and `eval passkey` with --sequence-parallel 2 or --context-parallel 2 on 2 ranks (torchrun, gloo, real
DeepSpeed-Ulysses groups, the ring of tapetrain.parallel.context) give one process's numbers: perplexity per length
within 1e-5 for TAPE, ALiBi and RoPE (the ring: TAPE and ALiBi), and the same passkey answers as one process
decoding with the KV cache. And every refusal comes before anything runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hf_runs import make_run, train_tiny_tokenizer

from tapetrain.checkpoint.hf_export import export_hf
from tapetrain.cli import main
from tapetrain.errors import InputError
from tapetrain.eval.passkey import run_eval_passkey
from tapetrain.eval.ppl import position_runs, run_eval_ppl

REPO = Path(__file__).resolve().parents[2]
PPL_LENGTHS = [32, 96, 160]  # 160 > the tiny model's 128-token context
PASSKEY = ["--protocol", "tapetrain", "--lengths", "100,140", "--trials", "3", "--batch-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny trained runs (TAPE, ALiBi, RoPE) on the passkey tokenizer, a TAPE export and 700 tokens of data."""
    root = tmp_path_factory.mktemp("evalsp")
    tokenizer = train_tiny_tokenizer(root / "tok.model")
    made = {pe: make_run(root / pe, pe, tokenizer=tokenizer) for pe in ("tape", "alibi", "rope")}
    export_hf(str(made["tape"]), str(root / "hf"))
    data = root / "tokens.bin"
    np.random.default_rng(3).integers(0, 512, 700).astype(np.uint16).tofile(data)
    return root, made, data


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # torchrun as this interpreter's module: a copied virtualenv's torchrun script may name another interpreter
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(
        cmd, cwd=cwd, timeout=600, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


RING_PES = ("tape", "alibi")  # under --context-parallel 2: TAPE and a baseline whose bias rows the ring indexes


def ppl_job(run: Path, data: Path, out: Path, split: list[str]) -> list[str]:
    lengths = ",".join(map(str, PPL_LENGTHS))
    return ["eval", "ppl", str(run), "--data", str(data), "--lengths", lengths, "--stride", "16", "--batch-size",
            "2", *split, "--out", str(out)]


@pytest.mark.slow
def test_ppl_on_two_ranks_equals_one_process(runs, tmp_path):
    """Ulysses (TAPE, ALiBi, RoPE) and the ring (TAPE, ALiBi) in one launch (the worker runs five `eval ppl` command
    lines). The sliding protocol scores only the last 16 predictions of later windows: under Ulysses one rank of the
    group holds them; under the ring (chunks of 8, 24 and 40 tokens) both ranks hold some, every window spans the
    chunk boundaries, and at 32 tokens the scored positions 16..31 are rank 1's chunk 2 and rank 0's chunk 3."""
    _, made, data = runs
    jobs = [ppl_job(made[pe], data, tmp_path / f"{pe}.json", ["--sequence-parallel", "2"]) for pe in made]
    jobs += [ppl_job(made[pe], data, tmp_path / f"ring-{pe}.json", ["--context-parallel", "2"]) for pe in RING_PES]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun([str(REPO / "tests" / "unit" / "eval_sp_worker.py"), str(tmp_path / "jobs.json")], REPO)
    for pe, run in made.items():
        one = run_eval_ppl(str(run), str(data), PPL_LENGTHS, stride=16, batch_size=2)
        assert (one["sequence_parallel"], one["context_parallel"]) == (1, 1)
        layouts = [("", (2, 1))] + ([("ring-", (1, 2))] if pe in RING_PES else [])
        for prefix, layout in layouts:
            two = json.loads((tmp_path / f"{prefix}{pe}.json").read_text())
            assert (two["world_size"], two["sequence_parallel"], two["context_parallel"]) == (2, *layout)
            for a, b in zip(one["results"], two["results"], strict=True):
                assert a["ppl"] > 1 and min(a["window_nll"]) > 0  # every window scores something
                assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5), (prefix, pe, a["length"])
                assert b["window_nll"] == pytest.approx(a["window_nll"], rel=1e-5), (prefix, pe, a["length"])
                assert (b["tokens"], b["windows"]) == (a["tokens"], a["windows"])


@pytest.mark.slow
def test_passkey_on_two_ranks_answers_as_one_process(runs, tmp_path):
    """The CLI's command lines under torchrun, Ulysses and the ring in one launch. Prompts of several token counts
    modulo 4, and every decoded token makes the sequence one longer, so both the padded and the unpadded sharded
    forward are exercised (the ring pads to a multiple of 2·R = 4)."""
    root, made, _ = runs
    one = run_eval_passkey(str(made["tape"]), [100, 140], protocol="tapetrain", trials=3, batch_size=2)
    sizes = {r["prompt_tokens"] % 4 for res in one["results"] for r in res["records"]}
    assert len(sizes) > 1 and sizes != {0}  # the ring pads to multiples of 4: padded and unpadded forwards
    jobs = [["eval", "passkey", str(made["tape"]), *PASSKEY, *split, "--out", str(tmp_path / f"{name}.json")]
            for name, split in (("two", ["--sequence-parallel", "2"]), ("ring", ["--context-parallel", "2"]))]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun([str(REPO / "tests" / "unit" / "eval_sp_worker.py"), str(tmp_path / "jobs.json")], REPO)
    for name, layout in (("two", (2, 1)), ("ring", (1, 2))):
        two = json.loads((tmp_path / f"{name}.json").read_text())
        assert (two["world_size"], two["sequence_parallel"], two["context_parallel"]) == (2, *layout)
        assert [r["records"] for r in two["results"]] == [r["records"] for r in one["results"]], name
        assert [r["accuracy"] for r in two["results"]] == [r["accuracy"] for r in one["results"]], name


def test_refusals_come_first_and_name_the_fix(runs, monkeypatch, capsys):
    """Each refusal is raised before a process group, DeepSpeed's groups or any weights (WORLD_SIZE is what a
    launcher sets; nothing here could join a group)."""
    root, made, data = runs
    run, hf = str(made["tape"]), str(root / "hf")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["eval", "ppl", run, "--data", str(data), "--lengths", "32", "--sequence-parallel", "2"]) == 1
    assert "needs a launch of 2 ranks" in capsys.readouterr().err
    with pytest.raises(InputError, match="needs a launch of 2 ranks .*torchrun --nproc-per-node 2"):
        run_eval_passkey(run, [100], protocol="tapetrain", sequence_parallel=2)
    with pytest.raises(InputError, match="must be >= 1"):
        run_eval_ppl(run, str(data), [32], sequence_parallel=0)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InputError, match="does not divide the 3 ranks .*launch a multiple of 2 ranks"):
        run_eval_ppl(run, str(data), [32], sequence_parallel=2)
    with pytest.raises(InputError, match="does not divide the model's 4 attention heads .*--sequence-parallel 1"):
        run_eval_ppl(run, str(data), [33], sequence_parallel=3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="needs a run directory, but .* is a Hugging Face export"):
        run_eval_ppl(hf, str(data), [32], sequence_parallel=2)
    with pytest.raises(InputError, match="needs a run directory, but .* is a Hugging Face export"):
        run_eval_passkey(hf, [100], protocol="tapetrain", sequence_parallel=2)
    with pytest.raises(InputError, match=r"--lengths 33,95: .*multiple of 2 .*33 -> 32, 95 -> 94"):
        run_eval_ppl(run, str(data), [32, 33, 95], sequence_parallel=2)


def test_ring_refusals_come_first_and_name_the_fix(runs, monkeypatch, capsys):
    """--context-parallel R: the same refusals in the ring's words, before any group or weights."""
    root, made, data = runs
    run, hf = str(made["tape"]), str(root / "hf")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["eval", "ppl", run, "--data", str(data), "--lengths", "32", "--context-parallel", "2"]) == 1
    assert "--context-parallel 2 needs a launch of 2 ranks" in capsys.readouterr().err
    with pytest.raises(InputError, match="must be >= 1"):
        run_eval_ppl(run, str(data), [32], context_parallel=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="--context-parallel 2 --sequence-parallel 2 does not divide the 2 ranks"):
        run_eval_ppl(run, str(data), [32], sequence_parallel=2, context_parallel=2)
    with pytest.raises(InputError, match="--context-parallel 2 needs a run directory, but .* Hugging Face export"):
        run_eval_passkey(hf, [100], protocol="tapetrain", context_parallel=2)
    # each window is cut into 2R = 4 chunks: 34 is even (fine for --sequence-parallel 2) but not a multiple of 4
    with pytest.raises(InputError, match=r"--lengths 34: with --context-parallel 2 .*multiple of 4 .*34 -> 32"):
        run_eval_ppl(run, str(data), [32, 34], context_parallel=2)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(InputError, match=r"--lengths 40: .*multiple of 12 \(the ring cuts each window into 6 chunks, "
                       r"each split over 2 rank\(s\)\); .*40 -> 36"):
        run_eval_ppl(run, str(data), [36, 40], context_parallel=3, sequence_parallel=2)


def test_position_runs_slice_a_ring_ranks_two_chunks():
    """Scoring slices logits per run of consecutive positions: one for a contiguous slice, two for a ring rank's
    chunks (rank 0 of R = 2 at 16 tokens: 0..3 and 12..15), one where its chunks meet (rank 1: 4..11)."""
    assert position_runs(torch.arange(8, 16)) == [(0, 8, 8)]
    assert position_runs(torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])) == [(0, 0, 4), (4, 12, 4)]
    assert position_runs(torch.arange(4, 12)) == [(0, 4, 8)]
    assert position_runs(torch.tensor([], dtype=torch.long)) == []


def test_passkey_refuses_randpe_drawing_at_eval(tmp_path, monkeypatch):
    """Sharded decoding pads the sequence, and a draw of positions at evaluation would see the padded length."""
    run = make_run(tmp_path / "randpe", "randpe", randpe_sample_at_eval=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="randpe_sample_at_eval"):
        run_eval_passkey(str(run), [100], protocol="tapetrain", sequence_parallel=2)
