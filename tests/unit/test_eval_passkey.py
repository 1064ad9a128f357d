"""Our own passkey protocol (--protocol tapetrain) and its needle grid (--depths) end to end on a tiny model with a
tiny sentencepiece tokenizer (accuracy is whatever it is). The reference protocols are in
test_eval_passkey_reference.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf_runs import passkey_run_and_export

from tapetrain.cli import main
from tapetrain.data.tokenizer import Tokenizer
from tapetrain.eval.passkey import MAX_PASS_KEY, QUESTION, SENTENCES, build_prompt, key_line, run_eval_passkey

REPO = Path(__file__).resolve().parents[2]

LENGTHS = [128, 256]  # 256 > the tiny model's 128-token context: extrapolation


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return passkey_run_and_export(tmp_path_factory.mktemp("passkey"))


def test_prompt_holds_the_key_at_the_stated_position(setup):
    _, _, tokenizer = setup
    tok = Tokenizer(tokenizer)
    positions = set()
    for trial in range(6):
        prompt = build_prompt(tok, 256, seed=0, trial=trial)
        line = tok.encode(key_line(prompt.pass_key))
        assert prompt.ids[prompt.key_position:prompt.key_position + prompt.key_tokens] == line
        assert 1 <= prompt.pass_key <= MAX_PASS_KEY and len(prompt.ids) <= 256
        assert prompt.ids[0] == tok.bos_id and key_line(prompt.pass_key) in tok.decode(prompt.ids)
        assert prompt.answer_ids == tok.encode(str(prompt.pass_key))
        positions.add(prompt.key_position)
        again = build_prompt(tok, 256, seed=0, trial=trial)
        assert (again.ids, again.pass_key) == (prompt.ids, prompt.pass_key)  # seeded per trial
    assert len(positions) > 1  # the key moves between trials
    assert build_prompt(tok, 256, seed=1, trial=0).pass_key != build_prompt(tok, 256, seed=0, trial=0).pass_key
    with pytest.raises(ValueError, match="too short"):
        build_prompt(tok, 20, seed=0, trial=0)


def test_passkey_end_to_end_run_dir_and_export(setup, tmp_path, caplog):
    caplog.set_level("INFO", logger="tapetrain.eval")
    run, hf, _ = setup
    reports = {}
    for name, model in (("run", run), ("hf", hf)):
        assert main(["eval", "passkey", str(model), "--protocol", "tapetrain",
                     "--lengths", ",".join(map(str, LENGTHS)), "--trials", "3",
                     "--out", str(tmp_path / f"{name}.json"),
                     "--plot", str(tmp_path / f"{name}.png")]) == 0
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    report = reports["hf"]
    assert {"model", "tokenizer", "trials", "seed", "results", "prompt_texts"} <= set(report)
    assert [r["length"] for r in report["results"]] == LENGTHS
    for result in report["results"]:
        assert result["trials"] == 3 and len(result["records"]) == 3
        assert result["accuracy"] == result["correct"] / 3
        for record in result["records"]:
            assert {"pass_key", "key_position", "depth", "generated", "correct"} <= set(record)
            assert record["prompt_tokens"] <= result["length"]
    # Same prompts and the same greedy answers from the run directory and from its export.
    assert [r["records"] for r in reports["run"]["results"]] == [r["records"] for r in report["results"]]
    # Prompts are whole filler sentences, so a length is met from below: the log says so (it used to be silent).
    for result in report["results"]:
        shortest = min(r["prompt_tokens"] for r in result["records"])
        assert f"passkey@{result['length']}: prompts of {shortest}-" in caplog.text
    again = run_eval_passkey(str(hf), LENGTHS, protocol="tapetrain", trials=3)
    assert again["results"] == report["results"]  # deterministic per seed


def test_the_job_says_its_size_first_and_an_eta_after_the_first_prompts(setup, caplog):
    """`eval passkey` on its defaults ran 1.5 h without a word on how long it would take."""
    caplog.set_level("INFO", logger="tapetrain.eval")
    _, hf, _ = setup
    run_eval_passkey(str(hf), LENGTHS, protocol="tapetrain", trials=2)
    messages = [r.getMessage() for r in caplog.records]
    size = [m for m in messages if "prompts (" in m]
    assert size and "4 prompts (2 lengths x 2 trials" in size[0], messages
    eta = [m for m in messages if "ETA" in m]
    assert len(eta) == 1 and "2 of 4 prompts" in eta[0], messages
    assert messages.index(size[0]) < messages.index(eta[0])


def test_accuracy_axis_is_0_to_1_even_when_every_trial_fails():
    """With every accuracy 0 the y-axis ran from -0.04 to 0.04."""
    from tapetrain.eval.report import passkey_figure

    for accuracies in ([0.0, 0.0], [0.5, 0.75], [1.0, 1.0]):
        report = {"model": "m", "protocol": "tape",
                  "results": [{"length": n, "accuracy": a} for n, a in zip(LENGTHS, accuracies, strict=True)]}
        assert passkey_figure([report]).axes[0].get_ylim() == (0.0, 1.0)


def test_needle_grid_places_the_key_at_depth_times_the_haystack(setup):
    """Cell placement: the key's token offset into the haystack (the filler between the task and the question) is
    depth x the haystack's tokens within half of the longest filler sentence; 0 puts the key right after the task,
    1 right before the question; the prompt is whole sentences up to the length. Seeding: one pass key per
    (seed, length, trial) at every depth, another seed gives other keys."""
    _, _, tokenizer = setup
    tok = Tokenizer(tokenizer)
    longest = max(len(tok.encode(s)) for s in SENTENCES)
    question = tok.encode(QUESTION)
    depths = [i / 10 for i in range(11)]
    for length in (128, 256, 512):
        for trial in range(3):
            prompts = [build_prompt(tok, length, seed=0, trial=trial, depth=d) for d in depths]
            assert len({p.pass_key for p in prompts}) == 1 and len({len(p.ids) for p in prompts}) == 1
            for depth, p in zip(depths, prompts, strict=True):
                assert p.ids[p.key_position:p.key_position + p.key_tokens] == tok.encode(key_line(p.pass_key))
                offset = p.key_position - p.haystack_start
                assert abs(offset - depth * p.haystack_tokens) <= longest / 2, (length, depth, offset)
                assert length - longest < len(p.ids) <= length
                assert p.ids[-len(question):] == question
            assert prompts[0].key_position == prompts[0].haystack_start
            assert prompts[-1].key_position + prompts[-1].key_tokens == len(prompts[-1].ids) - len(question)
            again = build_prompt(tok, length, seed=0, trial=trial, depth=0.3)
            assert again.ids == build_prompt(tok, length, seed=0, trial=trial, depth=0.3).ids
        keys = {build_prompt(tok, length, seed=0, trial=t, depth=0.5).pass_key for t in range(3)}
        other = {build_prompt(tok, length, seed=7, trial=t, depth=0.5).pass_key for t in range(3)}
        assert len(keys) == 3 and keys.isdisjoint(other)
    with pytest.raises(ValueError, match="every depth must lie in"):
        run_eval_passkey(str(setup[1]), [128], protocol="tapetrain", depths=[0.5, 1.5])


@pytest.mark.slow
def test_needle_grid_cells_heatmap_batches_and_two_ranks(setup, tmp_path):
    """The grid's JSON cells and heatmap; batched decoding gives the records of one prompt at a time, and two
    ranks under torchrun give the records of one."""
    import matplotlib.image

    _, hf, _ = setup
    depths, trials, lengths = [0.0, 0.5, 1.0], 2, [128, 256]
    args = ["eval", "passkey", str(hf), "--protocol", "tapetrain", "--lengths", "128,256", "--depths", "0,0.5,1",
            "--trials", str(trials)]
    assert main([*args, "--out", str(tmp_path / "one.json"), "--plot", str(tmp_path / "grid.png")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert [(c["length"], c["depth"]) for c in one["cells"]] == [(n, d) for n in lengths for d in depths]
    for cell in one["cells"]:
        records = [r for res in one["results"] if res["length"] == cell["length"] for r in res["records"]
                   if r["target_depth"] == cell["depth"]]
        assert cell["n"] == trials == len(records)
        assert cell["accuracy"] == sum(r["correct"] for r in records) / trials
        assert all(abs(r["depth"] - cell["depth"]) < 0.1 for r in records)
    image = matplotlib.image.imread(str(tmp_path / "grid.png"))  # (H, W, RGBA)
    assert image.shape[0] > 200 and image.shape[1] > 300
    one_at_a_time = run_eval_passkey(str(hf), lengths, protocol="tapetrain", depths=depths, trials=trials,
                                     batch_size=1)
    assert [r["records"] for r in one_at_a_time["results"]] == [r["records"] for r in one["results"]]

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tapetrain.cli", *args,
           "--out", str(tmp_path / "two.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=600, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2
    assert two["cells"] == one["cells"]
    assert [r["records"] for r in two["results"]] == [r["records"] for r in one["results"]]


@pytest.mark.slow
def test_the_documented_deepspeed_launch_of_eval_passkey_and_ppl(setup, tmp_path):
    """Issue #40: `deepspeed --num_gpus 2 --module tapetrain.cli eval passkey|ppl ...` (the documented launch) put
    --local_rank=N before the subcommand and both ranks exited 2; one small launch of each on 2 CPU ranks."""
    import random
    import shutil

    import numpy as np

    _, hf, _ = setup
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(1).integers(3, 100, 600).astype(np.uint16).tofile(tokens)
    deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    jobs = {"passkey": ["passkey", str(hf), "--protocol", "tapetrain", "--lengths", "128", "--trials", "2"],
            "ppl": ["ppl", str(hf), "--data", str(tokens), "--lengths", "64"]}
    for name, args in jobs.items():
        cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(random.randint(20000, 40000)), "--module",
               "tapetrain.cli", "eval", *args, "--out", str(tmp_path / f"{name}.json")]
        proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=300, capture_output=True,
                              text=True)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert json.loads((tmp_path / f"{name}.json").read_text())["world_size"] == 2
