"""Hugging Face tokenizers (tokenizer.json, byte-level BPE, as Llama-3 / Qwen ship them) next to sentencepiece:
prepare, special tokens from the tokenizer's own config, exports that AutoTokenizer loads, passkey and compare on
such an export. Tokenizers are trained in-test (tests/tiny_tokenizers.py); no downloads."""

import json
from pathlib import Path

import numpy as np
import pytest
from model_helpers import build
from test_hf_runs import train_tiny_tokenizer
from tiny_tokenizers import write_bpe_tokenizer

from tapetrain.cli import main

TEXT = "The pass key is 71432. Remember it.\nHello, world! 3.14 -- done."


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {"llama3": write_bpe_tokenizer(root / "llama3", "llama3"),
            "qwen": write_bpe_tokenizer(root / "qwen", "qwen"),
            "sentencepiece": Path(train_tiny_tokenizer(root / "tok.model"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"{TEXT} document {i}."}) + "\n" for i in range(40)))
    return path


def test_special_tokens_come_from_the_tokenizer_config(toks):
    from tapetrain.data.tokenizer import open_tokenizer

    llama = open_tokenizer(str(toks["llama3"]))
    assert llama.kind == "huggingface"
    assert llama.piece(llama.bos_id) == "<|begin_of_text|>" and llama.piece(llama.eos_id) == "<|end_of_text|>"
    assert llama.pad_id == -1
    qwen = open_tokenizer(str(toks["qwen"].parent))  # a model directory
    assert qwen.bos_id == -1  # Qwen: no BOS
    assert qwen.piece(qwen.eos_id) == "<|endoftext|>" and qwen.pad_id == qwen.eos_id
    for tok in (llama, qwen):
        ids = tok.encode(TEXT)
        assert tok.decode(ids) == TEXT and tok.bos_id not in ids
        assert tok.encode_batch([TEXT, "x"]) == [ids, tok.encode("x")]


@pytest.mark.parametrize("given", ["file", "directory"])
def test_prepare_with_a_tokenizer_json_or_its_model_directory(toks, corpus, tmp_path, given):
    from tapetrain.data.packed import PackedDataset
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import open_tokenizer

    path = toks["llama3"] if given == "file" else toks["llama3"].parent
    assert main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(path), "--out",
                 str(tmp_path / "d"), "--workers", "2"]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    tok = open_tokenizer(str(toks["llama3"]))
    assert manifest["tokenizer"]["path"] == str(toks["llama3"]) and manifest["tokenizer"]["sha256"] == tok.checksum
    assert manifest["eos_id"] == tok.eos_id and manifest["bos_id"] == tok.bos_id
    data = PackedDataset(str(tmp_path / "d"), 1)
    first = tok.encode(f"{TEXT} document 0.") + [tok.eos_id]
    assert data.tokens(0, len(first)).tolist() == first
    if given == "file":  # one worker writes the same shards as two
        prepare([str(corpus)], str(path), str(tmp_path / "d1"), progress=False)
        assert np.array_equal(PackedDataset(str(tmp_path / "d1"), 1).tokens(0, data.num_tokens),
                              data.tokens(0, data.num_tokens))


@pytest.fixture(scope="module")
def exports(toks, tmp_path_factory):
    from tapetrain.checkpoint.hf_export import export_model

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind, path in toks.items():
        result = export_model(build("rope"), str(root / kind), tokenizer=str(path))
        out[kind] = (root / kind, result)
    return out


@pytest.mark.parametrize("kind", ["llama3", "qwen", "sentencepiece"])
def test_export_carries_the_tokenizer_autotokenizer_loads(toks, exports, kind):
    from transformers import AutoTokenizer

    from tapetrain.data.format import file_sha256
    from tapetrain.data.tokenizer import open_tokenizer

    export, result = exports[kind]
    assert result["tokenizer"]["status"] == "loadable", result["tokenizer"]
    ours = open_tokenizer(str(toks[kind]))
    hf = AutoTokenizer.from_pretrained(str(export), trust_remote_code=True)
    assert hf(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)
    assert (hf.bos_token_id if hf.bos_token_id is not None else -1) == ours.bos_id
    assert hf.eos_token_id == ours.eos_id
    mine = open_tokenizer(str(export))  # what eval/compare use: the export's own file, byte for byte
    assert mine.checksum == file_sha256(str(toks[kind])) and mine.encode(TEXT) == ours.encode(TEXT)
    config = json.loads((export / "config.json").read_text())
    assert config["eos_token_id"] == ours.eos_id


@pytest.mark.parametrize("kind", ["llama3", "qwen"])
def test_passkey_and_compare_on_an_export_with_a_tokenizer_json(exports, toks, tmp_path, kind):
    export, _ = exports[kind]
    assert main(["eval", "passkey", str(export), "--protocol", "tapetrain", "--lengths", "128", "--trials", "1",
                 "--out", str(tmp_path / "p.json")]) == 0
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["tokenizer"] == str(export / "tokenizer.json")
    assert main(["compare", str(export), "--suite", "needle", "--lengths", "128", "--trials", "1",
                 "--depths", "0.5", "--resamples", "10", "--tokenizer", str(toks[kind].parent),
                 "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["options"]["tokenizer"] == str(toks[kind].parent)
    text = tmp_path / "text.txt"
    text.write_text(" ".join([TEXT] * 30))
    assert main(["eval", "ppl", str(export), "--data", str(text), "--lengths", "64",
                 "--out", str(tmp_path / "ppl.json")]) == 0  # text tokenized with the export's tokenizer.json
    assert json.loads((tmp_path / "ppl.json").read_text())["results"][0]["ppl"] > 1


def test_an_export_without_a_tokenizer_names_the_option(tmp_path):
    from tapetrain.checkpoint.hf_export import export_model

    export_model(build("rope"), str(tmp_path / "bare"))
    assert main(["eval", "passkey", str(tmp_path / "bare"), "--protocol", "tapetrain", "--lengths", "128",
                 "--trials", "1"]) == 1


def test_scrolls_data_with_a_tokenizer_json_keeps_it_and_starts_without_bos(toks, tmp_path):
    from tapetrain.data.examples import ExampleStore, tokenizer_of
    from tapetrain.data.scrolls import PromptBuilder, write_scrolls_data
    from tapetrain.data.tokenizer import open_tokenizer

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "scrolls" / "qasper.jsonl"
    write_scrolls_data("qasper", str(fixture), str(toks["qwen"].parent), str(tmp_path / "s"), seq_len=256,
                       max_answer_tokens=16, progress=False)
    tok = open_tokenizer(str(toks["qwen"]))
    kept = tokenizer_of(str(tmp_path / "s"))
    assert kept == str(tmp_path / "s" / "tokenizer.json") and open_tokenizer(kept).checksum == tok.checksum
    assert open_tokenizer(kept).eos_id == tok.eos_id  # its tokenizer_config.json came along
    row = json.loads(fixture.read_text().splitlines()[0])
    ids, prompt_len = ExampleStore(str(tmp_path / "s")).example(0)
    assert ids[:prompt_len].tolist() == PromptBuilder("qasper", tok, 256, 16).prompt(row["input"])[0]
    assert ids[0] != tok.bos_id and ids[-1] == tok.eos_id


def test_a_bare_tokenizer_json_takes_its_eos_from_the_command_line(toks, corpus, tmp_path, capsys):
    """A tokenizer.json alone (as the `tokenizers` library trains it: no tokenizer_config.json) names no EOS:
    prepare says to name it with --eos-token; named, the dataset's tokenizer copy carries it, the manifest names that
    copy (what a run adopts and keeps), and an export of it gives AutoTokenizer that EOS."""
    from transformers import AutoTokenizer

    from tapetrain.checkpoint.export_tokenizer import write_tokenizer
    from tapetrain.data.tokenizer import open_tokenizer

    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_bytes(toks["qwen"].read_bytes())
    argv = ["data", "prepare", "--input", str(corpus), "--tokenizer", str(bare), "--out", str(tmp_path / "d")]
    assert main(argv) == 1
    assert "has no EOS id" in (err := capsys.readouterr().err) and "--eos-token" in err, err
    assert main([*argv, "--eos-token", "<|nothing|>"]) == 1
    assert "--eos-token '<|nothing|>' is not a token of" in capsys.readouterr().err
    assert main([*argv, "--eos-token", "<|endoftext|>"]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    eos = open_tokenizer(str(bare), "<|endoftext|>").eos_id
    assert eos >= 0 and manifest["eos_id"] == eos
    copy = Path(manifest["tokenizer"]["path"])
    assert copy == tmp_path / "d" / "tokenizer" / "tokenizer.json" and copy.read_bytes() == bare.read_bytes()
    assert open_tokenizer(str(copy)).eos_id == eos  # complete without the flag
    assert not (bare.parent / "tokenizer_config.json").exists()  # the user's tokenizer is left as it was
    (tmp_path / "export").mkdir()
    write_tokenizer(str(copy), tmp_path / "export", 128)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "export")).eos_token == "<|endoftext|>"
    # SCROLLS data takes the same option; its store keeps the tokenizer with the EOS named.
    from tapetrain.data.examples import ExampleStore, tokenizer_of

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "scrolls" / "qasper.jsonl"
    scrolls = ["data", "scrolls", "--task", "qasper", "--input", str(fixture), "--tokenizer", str(bare), "--out",
               str(tmp_path / "s"), "--seq-len", "256", "--max-answer-tokens", "16"]
    assert main(scrolls) == 1 and "--eos-token" in capsys.readouterr().err
    assert main([*scrolls, "--eos-token", "<|endoftext|>"]) == 0
    assert open_tokenizer(tokenizer_of(str(tmp_path / "s"))).eos_id == eos
    assert ExampleStore(str(tmp_path / "s")).example(0)[0][-1] == eos
    # A config that names the BOS but no EOS: the copy keeps the BOS and adds the EOS named.
    from tapetrain.data.tokenizer import write_copy

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer.json").write_bytes(toks["llama3"].read_bytes())
    config = json.loads((toks["llama3"].parent / "tokenizer_config.json").read_text())
    (partial / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    named = open_tokenizer(str(partial), "<|end_of_text|>")
    kept = open_tokenizer(write_copy(named, str(tmp_path / "partial-copy")))
    assert (kept.bos_id, kept.eos_id) == (named.bos_id, named.eos_id) and min(kept.bos_id, kept.eos_id) >= 0
    # A tokenizer whose own config names another EOS is not overridden.
    assert main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(toks["qwen"]), "--out",
                 str(tmp_path / "d2"), "--eos-token", "<|im_end|>"]) == 1
    assert "is not the EOS the tokenizer's config files name" in capsys.readouterr().err
