"""Tokenizer training and `prepare`: exact token counts, shard layout, worker determinism, re-run rules."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random

import numpy as np
import pytest
import sentencepiece as spm

import tapetrain.data.prepare as prepare_module
from tapetrain.data import format as fmt
from tapetrain.data.errors import DataError
from tapetrain.data.prepare import prepare
from tapetrain.data.tokenizer import Tokenizer, train_tokenizer

VOCAB = 400


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "pa", "qui", "dor", "ve", "ny", "zä"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    def line() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) + f". {rng.randint(0, 999)}"

    return ["\n".join(line() for _ in range(rng.randint(1, 3))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    docs = make_docs(240)
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tok = train_tokenizer([str(path)], VOCAB, str(root / "tok.model"))
    return {"root": root, "docs": docs, "jsonl": str(path), "tok": tok}


def shard_bytes(out_dir) -> dict[str, bytes]:
    names = sorted(f for f in os.listdir(out_dir) if f.endswith(".bin"))
    return {f: open(os.path.join(out_dir, f), "rb").read() for f in names}


def test_tokenizer_ids_roundtrip_and_checksum(corpus):
    tok = Tokenizer(corpus["tok"])
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (VOCAB, 1, 2)
    text = "kato   ri\n\tunseen ✓ 12"  # byte fallback + identity normalization: exact round trip
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.checksum == hashlib.sha256(open(corpus["tok"], "rb").read()).hexdigest()
    assert not any(name.startswith(".tok-train") for name in os.listdir(corpus["root"]))  # temp dir cleaned


def test_tokenizer_errors(tmp_path, corpus):
    with pytest.raises(DataError, match="does not exist; pass a sentencepiece .model, a Hugging Face tokenizer.json"):
        Tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="is not a sentencepiece model"):
        Tokenizer(str(tmp_path / "junk.model"))
    with pytest.raises(DataError, match="lower --vocab-size"):
        train_tokenizer([corpus["jsonl"]], 50_000, str(tmp_path / "big.model"))


def test_manifest_counts_match_sentencepiece(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare([corpus["jsonl"]], corpus["tok"], str(out), shard_tokens=500, progress=False)
    sp = spm.SentencePieceProcessor(model_file=corpus["tok"])
    expected = [sp.encode(d) + [sp.eos_id()] for d in corpus["docs"]]
    assert manifest["num_tokens"] == sum(map(len, expected))
    assert manifest["num_documents"] == len(corpus["docs"])
    ids = (manifest["vocab_size"], manifest["dtype"], manifest["eos_id"], manifest["bos_id"])
    assert ids == (VOCAB, "uint16", 2, 1)
    assert manifest["tokenizer"]["sha256"] == Tokenizer(corpus["tok"]).checksum
    shards = manifest["splits"]["train"]["shards"]
    assert all(s["num_tokens"] == 500 for s in shards[:-1]) and 0 < shards[-1]["num_tokens"] <= 500
    assert sum(s["num_documents"] for s in shards) == len(corpus["docs"])
    stream = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in shards])
    assert stream.tolist() == [t for doc in expected for t in doc]
    for s in shards:
        assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert not (out / fmt.INCOMPLETE_MARKER).exists()


def test_val_split_is_deterministic_per_document(corpus, tmp_path):
    def run(name: str, seed: int) -> dict:
        return prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / name), val_fraction=0.25, seed=seed,
                       progress=False)

    a, _, c = run("a", 1), run("b", 1), run("c", 2)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert shard_bytes(tmp_path / "a") != shard_bytes(tmp_path / "c")
    val_docs = a["splits"]["val"]["num_documents"]
    assert 0.1 * 240 < val_docs < 0.4 * 240
    assert val_docs + a["splits"]["train"]["num_documents"] == a["num_documents"] == 240
    assert a["num_tokens"] == c["num_tokens"]


def test_one_and_two_workers_give_identical_shards(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 16)  # many chunks in flight -> ordering is exercised
    kw = dict(val_fraction=0.1, shard_tokens=700, progress=False)
    prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "w1"), workers=1, **kw)
    prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "w2"), workers=2, **kw)
    one, two = shard_bytes(tmp_path / "w1"), shard_bytes(tmp_path / "w2")
    assert len(one) > 3 and one == two


def test_rerun_refuses_then_overwrites(corpus, tmp_path):
    out = str(tmp_path / "out")
    prepare([corpus["jsonl"]], corpus["tok"], out, progress=False)
    with pytest.raises(DataError, match=r"already holds a prepared dataset.*--overwrite"):
        prepare([corpus["jsonl"]], corpus["tok"], out, progress=False)
    # simulate an interrupted run: marker present, a stale extra shard and a temp file left behind
    open(os.path.join(out, fmt.INCOMPLETE_MARKER), "w").close()
    open(os.path.join(out, "train-00099.bin"), "wb").close()
    open(os.path.join(out, ".train-00100.bin.tmp"), "wb").close()
    with pytest.raises(DataError, match=r"contains an incomplete prepare run.*delete it or pass --overwrite"):
        prepare([corpus["jsonl"]], corpus["tok"], out, progress=False)
    manifest = prepare([corpus["jsonl"]], corpus["tok"], out, overwrite=True, progress=False)
    assert sorted(f for f in os.listdir(out)) == sorted(
        ["manifest.json", "tokenizer"] + [s["file"] for s in manifest["splits"]["train"]["shards"]])
    assert os.listdir(os.path.join(out, "tokenizer")) == ["tok.model"]  # a copy travels with the shards


def test_overwrite_keeps_the_old_dataset_until_the_new_one_is_complete(corpus, tmp_path):
    """A bad input with --overwrite must leave the finished dataset untouched (it used to be deleted first)."""
    out = tmp_path / "out"
    prepare([corpus["jsonl"]], corpus["tok"], str(out), progress=False)
    (out / "NOTES.txt").write_text("mine")  # not prepare's: survives a successful overwrite too
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "kato ri"}\n{oops\n')
    with pytest.raises(DataError, match="malformed JSON"):
        prepare([str(bad)], corpus["tok"], str(out), overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "out"]  # no temporary directory left behind
    good = tmp_path / "small.jsonl"
    good.write_text(json.dumps({"text": "mu sen lo"}) + "\n")
    manifest = prepare([str(good)], corpus["tok"], str(out), overwrite=True, progress=False)
    assert manifest["num_documents"] == 1 and (out / "NOTES.txt").read_text() == "mine"
    assert json.loads((out / "manifest.json").read_text())["num_documents"] == 1
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "out", "small.jsonl"]


def test_shards_without_manifest_count_as_incomplete(corpus, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train-00000.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="incomplete prepare run"):
        prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "out"), progress=False)


def test_skip_bad_is_counted_in_manifest(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "kato ri"}\n{oops\n{"text": "mu sen"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        prepare([str(bad)], corpus["tok"], str(tmp_path / "o1"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing left behind: no --overwrite needed
    manifest = prepare([str(bad)], corpus["tok"], str(tmp_path / "o2"), skip_bad=True, progress=False)
    assert manifest["skipped_records"] == 1 and manifest["num_documents"] == 2


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(DataError, match="--val-fraction must be in"):
        prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "o"), val_fraction=1.0)
    with pytest.raises(DataError, match="matches no file"):
        prepare([str(tmp_path / "none*.jsonl")], corpus["tok"], str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()  # nothing touched before the inputs were validated


def test_cli_commands(corpus, tmp_path, capsys):
    from tapetrain.cli import main

    tok = str(tmp_path / "cli.model")
    assert main(["data", "tokenizer", "--input", corpus["jsonl"], "--vocab-size", "300", "--out", tok]) == 0
    assert Tokenizer(tok).vocab_size == 300
    out = str(tmp_path / "cli_out")
    argv = ["data", "prepare", "--input", corpus["jsonl"], "--tokenizer", tok, "--out", out, "--val-fraction", "0.1",
            "--workers", "1", "--text-key", "text"]
    assert main(argv) == 0 and os.path.exists(os.path.join(out, "manifest.json"))
    # second run: refused with exit code 1 and the reason on stderr
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--skip-bad"]) == 0


def test_c4_json_gz_files_train_a_tokenizer_and_prepare(corpus, tmp_path, capsys):
    """The README's own `tapetrain data tokenizer --input 'c4/*.json.gz'` failed with "unsupported extension"."""
    from tapetrain.cli import main

    c4 = tmp_path / "c4"
    c4.mkdir()
    for i in range(2):
        docs = corpus["docs"][i * 120:(i + 1) * 120]
        lines = "".join(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": "u"}) + "\n" for d in docs)
        (c4 / f"c4-train.{i:05d}-of-01024.json.gz").write_bytes(gzip.compress(lines.encode()))
    assert main(["data", "tokenizer", "--input", str(c4 / "*.json.gz"), "--vocab-size", str(VOCAB),
                 "--out", str(tmp_path / "tok.model")]) == 0
    assert main(["data", "prepare", "--input", str(c4 / "*.json.gz"), "--tokenizer", str(tmp_path / "tok.model"),
                 "--out", str(tmp_path / "data")]) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["num_documents"] == 240
    # the same documents as the uncompressed corpus, tokenized by the same model: the same token count
    plain = prepare([corpus["jsonl"]], str(tmp_path / "tok.model"), str(tmp_path / "plain"), progress=False)
    assert plain["splits"]["train"]["num_tokens"] == manifest["splits"]["train"]["num_tokens"]


def test_a_val_split_asked_for_but_empty_is_an_error_and_split_docs_at_fills_it(corpus, tmp_path, capsys):
    """A .txt.gz is one document: --val-fraction 0.05 used to give an empty val split with only a warning."""
    from tapetrain.cli import main

    book = tmp_path / "book.txt.gz"
    book.write_bytes(gzip.compress("\n\n".join(corpus["docs"]).encode()))
    argv = ["data", "prepare", "--input", str(book), "--tokenizer", corpus["tok"], "--out", str(tmp_path / "d"),
            "--val-fraction", "0.05"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "no document" in err and "val" in err and "--split-docs-at" in err, err
    assert sorted(os.listdir(tmp_path)) == ["book.txt.gz"]  # nothing left behind
    assert main(argv + ["--split-docs-at", "64"]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    total = Tokenizer(corpus["tok"]).encode("\n\n".join(corpus["docs"]))
    assert manifest["split_docs_at"] == 64
    assert manifest["num_documents"] == -(-len(total) // 64)  # pieces of at most 64 tokens
    assert manifest["num_tokens"] == len(total) + manifest["num_documents"]  # one EOS per piece
    assert manifest["splits"]["val"]["num_documents"] > 0 and manifest["splits"]["train"]["num_documents"] > 0


def test_split_docs_at_gives_the_same_shards_for_any_number_of_workers(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 16)
    one = prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "a"), val_fraction=0.2, split_docs_at=8,
                  progress=False)
    two = prepare([corpus["jsonl"]], corpus["tok"], str(tmp_path / "b"), val_fraction=0.2, split_docs_at=8,
                  workers=2, progress=False)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b") and one["splits"] == two["splits"]
    assert one["num_documents"] > len(corpus["docs"])


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids.update(int(k) for k in f.read().split())
    return kids


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan nobody reaps stays in /proc as state Z, dead all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_of_prepare_takes_its_workers_down(corpus, tmp_path):
    """SIGKILL of `data prepare --workers 2` left its tokenizer workers running (hung for minutes, GBs of memory)."""
    import signal
    import subprocess
    import sys
    import time

    big = tmp_path / "big.jsonl"
    with open(big, "w", encoding="utf-8") as f:
        lines = [json.dumps({"text": d}) + "\n" for d in make_docs(2000, seed=1)]
        for _ in range(200):  # ~85 MB: many seconds of tokenizing on two workers (killed long before the end)
            f.writelines(lines)
    cmd = [sys.executable, "-m", "tapetrain.cli", "data", "prepare", "--input", str(big), "--tokenizer",
           corpus["tok"], "--out", str(tmp_path / "out"), "--workers", "2"]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            workers = _children(parent.pid)
            time.sleep(0.05)
        assert len(workers) >= 2, "prepare started no workers"
        time.sleep(0.3)  # let them start tokenizing
        assert parent.poll() is None, "prepare finished before it could be killed: make the corpus bigger"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [w for w in workers if _running(w)]
        assert not alive, f"workers {alive} outlived their SIGKILLed parent"
        # a re-run into the same --out starts at once: nothing of the killed run holds it
        rerun = subprocess.run([*cmd[:6], corpus["jsonl"], *cmd[7:]], capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        assert not (tmp_path / ".out.prepare.tmp").exists()
    finally:  # whatever happened, leave no process of this test behind
        for pid in [parent.pid, *workers]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_missing_manifest_names_a_prepare_command_that_works_as_written(corpus, tmp_path, capsys):
    """Every state of a data path without a usable manifest (missing, empty, shards left without a manifest, an
    interrupted run's marker) names a `tapetrain data prepare` command; filled in with the corpus and tokenizer, it
    runs on that very directory, and no message speaks in Python keywords (overwrite=True)."""
    import re
    import shlex

    from tapetrain.cli import main

    states = {
        "missing": lambda out: None,
        "empty": lambda out: out.mkdir(),
        "shards without a manifest": lambda out: (out.mkdir(), (out / "train-00000.bin").write_bytes(b"\0\0")),
        "interrupted": lambda out: (out.mkdir(), (out / fmt.INCOMPLETE_MARKER).touch()),
    }
    for n, (state, make) in enumerate(states.items()):
        out = tmp_path / f"data{n}"
        make(out)
        with pytest.raises(DataError) as raised:
            fmt.load_manifest(str(out))
        message = str(raised.value)
        assert not re.search(r"\w+=(True|False)", message), message
        (hint,) = re.findall(r"`(tapetrain data prepare [^`]*)`", message)
        argv = [{"CORPUS": corpus["jsonl"], "TOKENIZER": corpus["tok"]}.get(w, w) for w in shlex.split(hint)[1:]]
        assert main(argv) == 0, (state, hint, capsys.readouterr().err)
        assert fmt.load_manifest(str(out))["num_documents"] == len(corpus["docs"]), state
    with pytest.raises(DataError) as raised:
        prepare([corpus["jsonl"]], corpus["tok"], str(out), progress=False)
    assert "--overwrite" in str(raised.value) and "=True" not in str(raised.value)
