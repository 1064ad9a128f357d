"""A run that continues a (tiny, random) Llama-3- or Qwen3-style Hugging Face checkpoint with its own byte-level BPE
tokenizer.json: prepare with the checkpoint directory as --tokenizer, train with model.init_from and no
data.tokenizer, move the run and the data, then export / compare / eval from `/`. Real launcher runs."""

import json
import shutil
import subprocess
import sys

import pytest
from harness import REPO, env, losses, run, single_cmd, write_config
from tiny_families import tiny_hf_model
from tiny_tokenizers import write_bpe_tokenizer

pytestmark = pytest.mark.slow

TEXT = "The pass key is 71432. Remember it. What is the pass key?"


def tapetrain(*args: str, cwd: str = "/") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tapetrain.cli", *args]
    e = {**env(), "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)


def checkpoint(root, family: str, style: str):
    """A checkpoint directory: weights, config.json, tokenizer.json and tokenizer_config.json; and a corpus."""
    write_bpe_tokenizer(root / "ckpt", style)
    tiny_hf_model(family, vocab_size=512, max_position_embeddings=128).save_pretrained(root / "ckpt")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{TEXT} Document {i} is here and there."}) + "\n"
                              for i in range(300)))
    return root


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("llama3"), "llama3", "llama3")


@pytest.mark.parametrize("family,style", [("llama3", "llama3"), ("qwen3", "qwen")])
def test_continued_checkpoint_keeps_its_tokenizer_and_the_run_travels(tmp_path, family, style):
    source = checkpoint(tmp_path / "source", family, style)  # Qwen: no BOS, EOS <|endoftext|>
    ckpt = source / "ckpt"
    proc = tapetrain("data", "prepare", "--input", str(source / "corpus.jsonl"), "--tokenizer", str(ckpt),
                     "--out", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "data", tmp_path / "run",
                       model={"init_from": str(ckpt), "pe": "rope"},
                       train={"steps": 2, "save_interval": 2, "micro_batch_size": 2, "global_batch_size": 2})
    run(single_cmd(cfg))
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    written = (tmp_path / "run" / "config.yaml").read_text()
    kept = tmp_path / "run" / "tokenizer"
    assert (kept / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert (kept / "tokenizer_config.json").is_file()
    assert f"tokenizer: {kept / 'tokenizer.json'}" in written and f"- path: {tmp_path / 'data'}" in written

    # The run and its data move; nothing is run from the directory it was launched in.
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(tmp_path / "run", moved / "run")
    shutil.move(tmp_path / "data", moved / "data")
    export = moved / "hf"
    proc = tapetrain("export", "hf", str(moved / "run"), "--out", str(export))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((export / "tapetrain_export.json").read_text())
    assert info["tokenizer"]["status"] == "loadable" and info["tokenizer"]["kind"] == "huggingface"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tapetrain.data.tokenizer import open_tokenizer

    ours = open_tokenizer(str(ckpt))
    hf_tok = AutoTokenizer.from_pretrained(str(export))
    ids = hf_tok(TEXT, return_tensors="pt").input_ids
    assert ids[0].tolist() == [ours.bos_id] * (ours.bos_id >= 0) + ours.encode(TEXT)  # Llama-3: BOS first
    model = AutoModelForCausalLM.from_pretrained(str(export))
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 and isinstance(hf_tok.decode(out[0]), str)

    proc = tapetrain("eval", "passkey", str(export), "--protocol", "tapetrain", "--lengths", "128",
                     "--trials", "1", "--out", str(moved / "passkey.json"))
    assert proc.returncode == 0, proc.stderr
    proc = tapetrain("compare", str(moved / "run"), str(export), "--suite", "ppl,needle", "--lengths", "64",
                     "--needle-lengths", "128", "--trials", "1", "--depths", "0.5", "--resamples", "10",
                     "--data", str(moved / "data"), "--split", "train", "--max-tokens", "256",
                     "--labels", "run", "export", "--out", str(moved / "cmp"))
    assert proc.returncode == 0, proc.stderr


def test_shards_of_another_tokenizer_are_refused_naming_both(llama3, tmp_path):
    ckpt = llama3 / "ckpt"
    other = write_bpe_tokenizer(tmp_path / "qwen", "qwen")
    proc = tapetrain("data", "prepare", "--input", str(llama3 / "corpus.jsonl"), "--tokenizer", str(other),
                     "--out", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "data", tmp_path / "run",
                       model={"init_from": str(ckpt), "pe": "rope"})
    proc = subprocess.run(single_cmd(cfg, "--dry-run"), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1
    error = proc.stderr.strip().splitlines()[-1]
    assert f"model.init_from={ckpt}" in error and str(ckpt / "tokenizer.json") in error, error
    assert str(other) in error and "is not the tokenizer the data was prepared with" in error, error
    # data.tokenizer says otherwise: the data's tokenizer wins over the checkpoint's
    proc = subprocess.run(single_cmd(cfg, "--dry-run", f"data.tokenizer={other}"), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_run_launched_with_relative_paths_adopts_the_shards_tokenizer_and_travels(tmp_path):
    """sentencepiece shards, data.tokenizer null, data and run.out_dir relative to the launch directory."""
    from conftest import write_stdlib_corpus

    from tapetrain.data.tokenizer import train_tokenizer

    write_stdlib_corpus(tmp_path / "corpus.jsonl", slice(0, 3), max_chars=1800)
    train_tokenizer([str(tmp_path / "corpus.jsonl")], 512, str(tmp_path / "tok.model"))
    proc = tapetrain("data", "prepare", "--input", "corpus.jsonl", "--tokenizer", "tok.model", "--out", "data",
                     cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    cfg = write_config(tmp_path / "c.yaml", "data", "run",
                       train={"steps": 2, "save_interval": 2, "micro_batch_size": 2, "global_batch_size": 2})
    proc = subprocess.run([*single_cmd(cfg)], cwd=tmp_path, env={**env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("run", "data", "tok.model"):
        shutil.move(tmp_path / name, moved / name)
    proc = tapetrain("export", "hf", str(moved / "run"), "--out", str(moved / "hf"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((moved / "hf" / "tapetrain_export.json").read_text())
    assert info["tokenizer"]["status"] == "loadable", info["tokenizer"]
    assert (moved / "hf" / "tokenizer.model").read_bytes() == (moved / "tok.model").read_bytes()
    proc = tapetrain("compare", str(moved / "run"), "--suite", "needle", "--needle-lengths", "256", "--trials",
                     "1", "--depths", "0.5", "--resamples", "10", "--out", str(moved / "cmp"))
    assert proc.returncode == 0, proc.stderr
