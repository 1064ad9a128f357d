"""Perplexity: the three protocols against a hand computation, run dir vs HF export, data formats, bad inputs,
and two ranks under torchrun."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import build
from test_hf_runs import make_run, train_tiny_tokenizer

from tapetrain.checkpoint.hf_export import export_hf
from tapetrain.eval import windows as windows_module
from tapetrain.eval.models import EvalModel
from tapetrain.eval.ppl import evaluate_ppl, run_eval_ppl
from tapetrain.eval.tokens import EvalTokens
from tapetrain.eval.windows import Window, make_windows

REPO = Path(__file__).resolve().parents[2]


def eval_model(model) -> EvalModel:
    return EvalModel(model.eval(), "run", "tiny", model.cfg.vocab_size, model.cfg.max_seq_len, None,
                     torch.device("cpu"), "fp32")


def in_memory(tokens: np.ndarray) -> EvalTokens:
    return EvalTokens(lambda a, b: tokens[a:b].astype(np.int64), len(tokens), "in-memory")


def hand_ppl(model, tokens: np.ndarray, length: int, windows: list[tuple[int, list[int]]]) -> float:
    """Explicit loops: for each (start, scored offsets j), -log p(x[start + j + 1] | x[start .. start + j])."""
    total, count = 0.0, 0
    for start, offsets in windows:
        x = torch.tensor(tokens[start:start + length], dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0].double(), dim=-1)
        for j in offsets:
            total -= float(logp[j, int(tokens[start + j + 1])])
            count += 1
    return math.exp(total / count)


def test_protocols_match_hand_computation(monkeypatch):
    model = build("rope")
    tokens = np.random.default_rng(0).integers(0, 512, 10)  # 10 tokens, length 4, stride 2
    # nonoverlap: inputs x0..3 and x4..7, targets x1..x8 once each (x9 fits no complete window)
    assert make_windows(10, 4, "nonoverlap") == [Window(0, 0, 4), Window(4, 0, 4)]
    # sliding, stride 2: the first window scores all 4 targets, later ones their last 2 (x5 x6, then x7 x8)
    assert make_windows(10, 4, "sliding", 2) == [Window(0, 0, 4), Window(2, 2, 4), Window(4, 2, 4)]
    # longlora (window step shrunk from 256 to 2 for the test): starts range(0, 10 - 4, 2), all 3 in-window
    # predictions of each window (test_eval_protocols.py checks it against the reference scripts)
    monkeypatch.setattr(windows_module, "LONGLORA_STEP", 2)
    assert make_windows(10, 4, "longlora") == [Window(s, 0, 3) for s in (0, 2, 4)]
    expected = {
        "nonoverlap": hand_ppl(model, tokens, 4, [(0, [0, 1, 2, 3]), (4, [0, 1, 2, 3])]),
        "sliding": hand_ppl(model, tokens, 4, [(0, [0, 1, 2, 3]), (2, [2, 3]), (4, [2, 3])]),
        "longlora": hand_ppl(model, tokens, 4, [(s, [0, 1, 2]) for s in (0, 2, 4)]),
    }
    for protocol, ppl in expected.items():
        for batch_size in (1, 3):
            [result] = evaluate_ppl(eval_model(model), in_memory(tokens), [4], protocol,
                                    stride=2 if protocol == "sliding" else None, batch_size=batch_size)
            assert result["ppl"] == pytest.approx(ppl, rel=1e-6), protocol
            assert result["tokens"] == {"nonoverlap": 8, "sliding": 8, "longlora": 9}[protocol]
            assert result["nll"] == pytest.approx(math.log(result["ppl"]))


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    run = make_run(root / "run", "tape")
    export_hf(str(run), str(root / "hf"))
    data = root / "tokens.bin"
    np.random.default_rng(1).integers(0, 512, 1500).astype(np.uint16).tofile(data)
    return run, root / "hf", data


def test_run_dir_and_export_agree(run_and_export, tmp_path, caplog):
    run, hf, data = run_and_export
    reports = {}
    for name, model in (("run", run), ("hf", hf)):
        caplog.clear()
        reports[name] = run_eval_ppl(str(model), str(data), [16, 64, 160], out=str(tmp_path / f"{name}.json"),
                                     plot=str(tmp_path / f"{name}.png"), batch_size=2)
        assert "160 > the model's training context 128" in caplog.text  # extrapolation is allowed, and logged
    for ours, theirs in zip(reports["run"]["results"], reports["hf"]["results"], strict=True):
        assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)
        assert (ours["tokens"], ours["windows"]) == (theirs["tokens"], theirs["windows"])
    saved = json.loads((tmp_path / "hf.json").read_text())
    assert {"model", "data", "protocol", "results"} <= set(saved) and saved["protocol"] == "nonoverlap"
    assert [r["length"] for r in saved["results"]] == [16, 64, 160]
    assert {"length", "ppl", "nll", "tokens", "windows"} <= set(saved["results"][0])
    assert saved["results"][0]["tokens"] == 1499 - 1499 % 16  # every complete window, each target once
    run_eval_ppl(str(hf), str(data), [16, 32], protocol="longlora", plot=str(tmp_path / "both.png"),
                 compare=[str(tmp_path / "run.json")])
    assert (tmp_path / "both.png").stat().st_size > 1000


def test_shard_directory_reads_val_split(run_and_export, tmp_path):
    from tapetrain import atomic_io
    from tapetrain.data import format as fmt

    run, _, _ = run_and_export
    rng = np.random.default_rng(2)
    val, train = rng.integers(0, 512, 300), rng.integers(0, 512, 200)
    splits = {}
    for split, tokens in (("train", train), ("val", val)):
        writer = fmt.ShardWriter(str(tmp_path), split, "uint16", shard_tokens=128)  # val spans 3 shards
        writer.add(tokens, np.array([len(tokens)]))
        splits[split] = writer.close()
    manifest = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "vocab_size": 512, "dtype": "uint16",
                "bos_id": 1, "eos_id": 2, "num_tokens": 500, "splits": splits}
    atomic_io.write_json(str(tmp_path / fmt.MANIFEST), manifest)
    val.astype(np.uint16).tofile(tmp_path / "val.bin")
    shards = run_eval_ppl(str(run), str(tmp_path), [32])
    flat = run_eval_ppl(str(run), str(tmp_path / "val.bin"), [32])
    assert "val split" in shards["data"]
    assert shards["results"][0]["ppl"] == pytest.approx(flat["results"][0]["ppl"], rel=1e-9)
    with pytest.raises(ValueError, match="dtype mismatch"):
        run_eval_ppl(str(run), str(tmp_path), [32], token_dtype="uint32")


def test_text_file_is_tokenized(run_and_export, tmp_path):
    from tapetrain.data.tokenizer import Tokenizer

    run, _, _ = run_and_export
    tokenizer = train_tiny_tokenizer(tmp_path / "tok.model")
    text = "The grass is green. The sky is blue. The pass key is 12345. Remember it. " * 8
    (tmp_path / "doc.txt").write_text(text)
    ids = Tokenizer(tokenizer).encode(text) + [2]  # the document ends with EOS, as prepare writes it
    np.array(ids, dtype=np.uint16).tofile(tmp_path / "doc.bin")
    from_text = run_eval_ppl(str(run), str(tmp_path / "doc.txt"), [32], tokenizer=tokenizer)
    from_bin = run_eval_ppl(str(run), str(tmp_path / "doc.bin"), [32])
    assert from_text["data_tokens"] == len(ids)
    assert from_text["results"][0]["ppl"] == pytest.approx(from_bin["results"][0]["ppl"], rel=1e-9)


def test_bad_inputs_fail_clearly(run_and_export, tmp_path):
    run, hf, data = run_and_export
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_eval_ppl(str(hf), str(tmp_path / "missing.bin"), [16])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_eval_ppl(str(tmp_path / "no_model"), str(data), [16])
    bad = tmp_path / "big_ids.bin"
    np.array([5, 7, 600, 3] * 50, dtype=np.uint16).tofile(bad)
    with pytest.raises(ValueError, match="600 .*vocab_size=512"):
        run_eval_ppl(str(hf), str(bad), [16])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        run_eval_ppl(str(run), str(odd), [16])
    with pytest.raises(ValueError, match="needs at least 2001 tokens .* holds 1500"):
        run_eval_ppl(str(run), str(data), [16, 2000])
    with pytest.raises(ValueError, match="needs at least 65 tokens .* holds 50"):
        run_eval_ppl(str(run), str(data), [64], max_tokens=50)
    with pytest.raises(ValueError, match="--stride applies to --protocol sliding"):
        run_eval_ppl(str(run), str(data), [16], protocol="longlora", stride=8)
    text = tmp_path / "doc.txt"
    text.write_text("The grass is green.")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        run_eval_ppl(str(run), str(text), [16])


@pytest.mark.slow
def test_two_ranks_match_one(run_and_export, tmp_path):
    run, _, data = run_and_export
    single = run_eval_ppl(str(run), str(data), [16, 64], stride=8)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(REPO / "tools" / "eval_ppl.py"),
           str(run), "--data", str(data), "--lengths", "16,64", "--stride", "8", "--out", str(tmp_path / "r.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=300, capture_output=True)
    double = json.loads((tmp_path / "r.json").read_text())
    assert double["world_size"] == 2
    for one, two in zip(single["results"], double["results"], strict=True):
        assert two["ppl"] == pytest.approx(one["ppl"], rel=1e-6)
        assert (two["tokens"], two["windows"]) == (one["tokens"], one["windows"])


def test_shards_of_another_tokenizer_are_refused(tmp_path):
    """Two tokenizers with the same vocab size: `eval ppl` used to score the other one's ids without a word."""
    import sysconfig

    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p.read_text(errors="replace")}) + "\n"
                              for p in sorted(stdlib.glob("*.py"))[:6]))
    mine = train_tiny_tokenizer(tmp_path / "mine.model")
    other = train_tokenizer([str(corpus)], 512, str(tmp_path / "other.model"))
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": (stdlib / "abc.py").read_text()[:3000]}) + "\n")
    prepare([str(small)], mine, str(tmp_path / "data_mine"), progress=False)
    prepare([str(small)], other, str(tmp_path / "data_other"), progress=False)
    run = make_run(tmp_path / "run", "rope", tokenizer=mine)
    export_hf(str(run), str(tmp_path / "hf"), verify=False)
    assert run_eval_ppl(str(run), str(tmp_path / "data_mine"), [16], split="train")["results"][0]["ppl"] > 1
    for model in (run, tmp_path / "hf"):  # the run's data.tokenizer, the export's tokenizer.model
        with pytest.raises(ValueError, match="tokenized with a tokenizer of sha256 .* was trained with sha256"):
            run_eval_ppl(str(model), str(tmp_path / "data_other"), [16], split="train")
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    with pytest.raises(ValueError, match="tokenized with a tokenizer of sha256"):
        run_eval_ppl(str(run), str(tmp_path / "doc.txt"), [16], tokenizer=other)
