"""`data` mode: `prepare` throughput at 1 and 2 workers and BatchIterator read throughput.

Steps (all in a temp dir unless `workdir`): generate a synthetic corpus (Zipf-distributed pseudo-words,
`corpus_mb` MB of JSONL), train a `vocab` tokenizer on it, run prepare with 1 and 2 workers (checking the shards
are identical), then write a synthetic `reader_tokens` token dataset and time BatchIterator over it for `seconds`
per sequence length. Reader figures are tokens (seq_len per sample) per second in one process, with the shards in
the page cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from tapetrain.bench.report import format_table


@dataclass
class DataSettings:
    workdir: str | None = None  # keep the generated data here (default: a temp dir, removed)
    corpus_mb: float = 8.0
    vocab: int = 4096
    reader_tokens: int = 64 << 20
    seq_lens: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    micro_batch: int = 8
    seconds: float = 4.0


def make_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Write ~megabytes of JSONL documents; return the document count."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = np.linspace(2.0, 0.1, len(letters))
    p = freq / freq.sum()
    words = ["".join(rng.choice(letters, int(rng.integers(1, 11)), p=p)) for _ in range(30_000)]
    words += [",", ".", "42", "1999", "\n"]
    target, written, docs = int(megabytes * 2**20), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            ids = np.minimum(rng.zipf(1.2, int(rng.integers(50, 800))), len(words)) - 1
            line = json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def write_synthetic_dataset(out_dir: str, template: dict, num_tokens: int, shard_tokens: int) -> None:
    """Random ids < vocab in prepare's layout; the manifest of a real run provides all but the splits."""
    from tapetrain.data import format as fmt

    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = fmt.ShardWriter(out_dir, "train", template["dtype"], shard_tokens)
    block = 1 << 22
    for start in range(0, num_tokens, block):
        n = min(block, num_tokens - start)
        writer.add(rng.integers(0, template["vocab_size"], n, dtype=np.int64), np.array([n]))
    train = writer.close()
    val = {"num_tokens": 0, "num_documents": 0, "shards": []}
    manifest = dict(template, splits={"train": train, "val": val}, num_tokens=train["num_tokens"],
                    num_documents=train["num_documents"], inputs=["synthetic"])
    fmt.write_json_atomic(os.path.join(out_dir, fmt.MANIFEST), manifest)


def bench_reader(path: str, seq_len: int, micro_batch: int, seconds: float) -> dict:
    from tapetrain.data.stream import BatchIterator, PackedDataset

    t0 = time.perf_counter()
    ds = PackedDataset(path, seq_len)
    open_s = time.perf_counter() - t0
    it = BatchIterator(ds, global_batch_size=micro_batch * 8, micro_batch_size=micro_batch, seed=0)
    it.next_micro_batch()  # warm-up: builds the epoch permutation
    batches, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(16):
            it.next_micro_batch()
        batches += 16
    samples_per_s = batches * micro_batch / elapsed
    return {"seq_len": seq_len, "micro_batch": micro_batch, "num_samples": ds.num_samples, "open_s": open_s,
            "tokens_per_s": samples_per_s * seq_len, "samples_per_s": samples_per_s}


def _same_files(a: str, b: str, shards: list[dict]) -> bool:
    def read(root: str, name: str) -> bytes:
        with open(os.path.join(root, name), "rb") as f:
            return f.read()

    return all(read(a, s["file"]) == read(b, s["file"]) for s in shards)


def run_data_benchmark(s: DataSettings) -> dict:
    """Corpus -> tokenizer -> prepare at 1 and 2 workers (identical shards?) -> reader throughput per seq_len."""
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    work = s.workdir or tempfile.mkdtemp(prefix="bench_data_")
    os.makedirs(work, exist_ok=True)
    result: dict = {"cpu_count": os.cpu_count(), "corpus_mb": s.corpus_mb, "vocab": s.vocab,
                    "reader_tokens": s.reader_tokens, "micro_batch": s.micro_batch}
    try:
        corpus = os.path.join(work, "corpus.jsonl")
        result["documents"] = make_corpus(corpus, s.corpus_mb)
        t0 = time.perf_counter()
        tok = train_tokenizer([corpus], s.vocab, os.path.join(work, "tok.model"), max_sentences=200_000)
        result["tokenizer_train_s"] = time.perf_counter() - t0
        result["prepare"] = []
        for workers in (1, 2):
            t0 = time.perf_counter()
            manifest = prepare([corpus], tok, os.path.join(work, f"prep_w{workers}"), workers=workers,
                               overwrite=True, progress=False)
            dt = time.perf_counter() - t0
            result["prepare"].append({"workers": workers, "seconds": dt, "tokens": manifest["num_tokens"],
                                      "tokens_per_s": manifest["num_tokens"] / dt,
                                      "docs_per_s": manifest["num_documents"] / dt, "mb_per_s": s.corpus_mb / dt})
        result["prepare_identical_1_vs_2_workers"] = _same_files(
            os.path.join(work, "prep_w1"), os.path.join(work, "prep_w2"), manifest["splits"]["train"]["shards"])
        synth = os.path.join(work, "synthetic")
        write_synthetic_dataset(synth, manifest, s.reader_tokens, shard_tokens=s.reader_tokens // 4 + 1)
        result["reader"] = [bench_reader(synth, n, s.micro_batch, s.seconds) for n in s.seq_lens]
    finally:
        if not s.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return result


def data_report(r: dict) -> str:
    prepare = format_table(
        ["workers", "seconds", "M tok/s", "docs/s", "MB/s"],
        [[p["workers"], p["seconds"], p["tokens_per_s"] / 1e6, p["docs_per_s"], p["mb_per_s"]] for p in r["prepare"]])
    reader = format_table(
        ["seq_len", "open s", "M tok/s", "samples/s"],
        [[x["seq_len"], x["open_s"], x["tokens_per_s"] / 1e6, x["samples_per_s"]] for x in r["reader"]])
    return (f"prepare ({r['corpus_mb']:g} MB JSONL, {r['documents']} docs, vocab {r['vocab']}; tokenizer trained in "
            f"{r['tokenizer_train_s']:.1f}s; identical shards: {r['prepare_identical_1_vs_2_workers']})\n{prepare}\n"
            f"reader (BatchIterator, 1 process, {r['reader_tokens'] / 2**20:.1f} Mi tokens, micro batch "
            f"{r['micro_batch']})\n{reader}")
