"""`data` mode: `prepare` throughput at 1 and 2 workers and BatchIterator read throughput.

Steps (all in a temp dir unless `workdir`): generate a synthetic corpus (Zipf-distributed pseudo-words,
`corpus_mb` MB of JSONL), train a `vocab` tokenizer on it, run prepare with 1 and 2 workers (checking the shards
are identical), then write a synthetic `reader_tokens` token dataset and time BatchIterator over it for `seconds`
per sequence length. Reader figures are tokens (seq_len per sample) per second in one process, with the shards in
the page cache.

With `remote_latency_ms` the same synthetic dataset (in smaller shards) is also served over HTTP on 127.0.0.1 with
that latency added to every request (tapetrain.bench.shard_server) and read as a URL through the shard cache: cold
(an empty cache: every shard fetched while reading, with the background prefetch) and warm (the same cache again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tapetrain.bench.arguments import add_report_args, ints
from tapetrain.bench.common import device_name
from tapetrain.bench.header import report_header
from tapetrain.bench.report import format_table

HELP = "prepare throughput (1 and 2 workers) and batch reader throughput"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p, plot=False, device=False, run=False)  # no figure, no model
    p.add_argument("--workdir", help="keep the generated data here (default: a temp dir, removed)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="synthetic JSONL corpus size in MB")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size")
    p.add_argument("--reader-tokens", type=int, default=64 << 20, help="tokens of the synthetic reader dataset")
    p.add_argument("--seq-lens", type=ints, default=[512, 2048, 8192], help="reader sequence lengths")
    p.add_argument("--micro-batch", type=int, default=8, help="reader samples per batch")
    p.add_argument("--seconds", type=float, default=4.0, help="reader time per sequence length")
    p.add_argument("--remote-latency-ms", type=float, default=None,
                   help="also read the dataset over HTTP on 127.0.0.1 with this latency per request (e.g. 50): "
                        "cold and warm shard cache")
    p.add_argument("--remote-shard-tokens", type=int, default=1 << 20, help="tokens per shard of the remote dataset")
    p.add_argument("--tokenizers", default="sentencepiece",
                   help="prepare with these, comma-separated: sentencepiece (a BPE .model), bpe (a byte-level BPE "
                        "tokenizer.json, as Llama-3 / Qwen ship); both are trained on the corpus with --vocab ids")


@dataclass
class DataSettings:
    workdir: str | None = None  # keep the generated data here (default: a temp dir, removed)
    corpus_mb: float = 8.0
    vocab: int = 4096
    reader_tokens: int = 64 << 20
    seq_lens: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    micro_batch: int = 8
    seconds: float = 4.0
    remote_latency_ms: float | None = None  # also time the reader over HTTP with this latency per request
    remote_shard_tokens: int = 1 << 20
    # prepare with: "sentencepiece" (BPE .model) and/or "bpe" (byte-level BPE tokenizer.json, as Llama-3 / Qwen)
    tokenizers: list[str] = field(default_factory=lambda: ["sentencepiece"])


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


def train_byte_level_bpe(corpus: str, vocab: int, out_dir: str) -> str:
    """A byte-level BPE tokenizer.json (GPT-2 pre-tokenizer, as Llama-3 / Qwen) of `vocab` ids trained on the
    corpus's texts, with a tokenizer_config.json naming its EOS; returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>"}, f)
    return os.path.join(out_dir, "tokenizer.json")


def write_synthetic_dataset(out_dir: str, template: dict, num_tokens: int, shard_tokens: int) -> None:
    """Random ids < vocab in prepare's layout; the manifest of a real run provides all but the splits."""
    from tapetrain import atomic_io
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
    atomic_io.write_json(os.path.join(out_dir, fmt.MANIFEST), manifest)


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


def bench_remote_reader(root: str, name: str, seq_len: int, micro_batch: int, seconds: float,
                        latency_ms: float) -> list[dict]:
    """Reader throughput from http://127.0.0.1 (+latency per request) through the shard cache: cold, then warm."""
    from tapetrain.bench.shard_server import ShardServer
    from tapetrain.data.cache import STATS, ShardCache
    from tapetrain.data.stream import BatchIterator, PackedDataset

    cache_dir = tempfile.mkdtemp(prefix="bench_cache_")
    rows = []
    try:
        with ShardServer(root, latency_s=latency_ms / 1e3) as server:
            for cache_state in ("cold", "warm"):
                before = STATS.snapshot()
                t0 = time.perf_counter()
                ds = PackedDataset(f"{server.url}/{name}", seq_len, cache=ShardCache(cache_dir, None))
                it = BatchIterator(ds, global_batch_size=micro_batch * 8, micro_batch_size=micro_batch, seed=0)
                open_s = time.perf_counter() - t0
                it.next_micro_batch()
                first_batch_s = time.perf_counter() - t0
                batches, t0 = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - t0) < seconds:
                    for _ in range(16):
                        it.next_micro_batch()
                    batches += 16
                ds.close()
                after = STATS.snapshot()
                samples_per_s = batches * micro_batch / elapsed
                rows.append({"cache": cache_state, "seq_len": seq_len, "latency_ms": latency_ms, "open_s": open_s,
                             "first_batch_s": first_batch_s, "tokens_per_s": samples_per_s * seq_len,
                             "samples_per_s": samples_per_s, "shards": len(ds.shards),
                             "fetched_mb": (after["data_fetched_bytes"] - before["data_fetched_bytes"]) / 1e6,
                             "requests": len(server.requests)})
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return rows


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
    header = report_header("data", device_name(torch.device("cpu")))  # prepare and the readers run on the CPU
    result: dict = {**header, "cpu_count": os.cpu_count(), "corpus_mb": s.corpus_mb, "vocab": s.vocab,
                    "reader_tokens": s.reader_tokens, "micro_batch": s.micro_batch}
    try:
        corpus = os.path.join(work, "corpus.jsonl")
        result["documents"] = make_corpus(corpus, s.corpus_mb)
        result["prepare"], identical = [], []
        for kind in s.tokenizers:
            t0 = time.perf_counter()
            if kind == "bpe":
                tok = train_byte_level_bpe(corpus, s.vocab, os.path.join(work, "bpe"))
            else:
                tok = train_tokenizer([corpus], s.vocab, os.path.join(work, "tok.model"), max_sentences=200_000)
            result.setdefault("tokenizer_train_s", time.perf_counter() - t0)
            for workers in (1, 2):
                t0 = time.perf_counter()
                manifest = prepare([corpus], tok, os.path.join(work, f"prep_{kind}_w{workers}"), workers=workers,
                                   overwrite=True, progress=False)
                dt = time.perf_counter() - t0
                result["prepare"].append({"tokenizer": kind, "workers": workers, "seconds": dt,
                                          "tokens": manifest["num_tokens"], "tokens_per_s": manifest["num_tokens"] / dt,
                                          "docs_per_s": manifest["num_documents"] / dt, "mb_per_s": s.corpus_mb / dt})
            identical.append(_same_files(os.path.join(work, f"prep_{kind}_w1"), os.path.join(work, f"prep_{kind}_w2"),
                                         manifest["splits"]["train"]["shards"]))
        result["prepare_identical_1_vs_2_workers"] = all(identical)
        synth = os.path.join(work, "synthetic")
        write_synthetic_dataset(synth, manifest, s.reader_tokens, shard_tokens=s.reader_tokens // 4 + 1)
        result["reader"] = [bench_reader(synth, n, s.micro_batch, s.seconds) for n in s.seq_lens]
        if s.remote_latency_ms is not None:
            small = os.path.join(work, "remote", "synthetic")
            write_synthetic_dataset(small, manifest, s.reader_tokens, shard_tokens=s.remote_shard_tokens)
            result["remote_reader"] = [row for n in s.seq_lens for row in bench_remote_reader(
                os.path.join(work, "remote"), "synthetic", n, s.micro_batch, s.seconds, s.remote_latency_ms)]
    finally:
        if not s.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return result


def data_report(r: dict) -> str:
    prepare = format_table(
        ["tokenizer", "workers", "seconds", "M tok/s", "docs/s", "MB/s"],
        [[p.get("tokenizer", "sentencepiece"), p["workers"], p["seconds"], p["tokens_per_s"] / 1e6, p["docs_per_s"],
          p["mb_per_s"]] for p in r["prepare"]])
    reader = format_table(
        ["seq_len", "open s", "M tok/s", "samples/s"],
        [[x["seq_len"], x["open_s"], x["tokens_per_s"] / 1e6, x["samples_per_s"]] for x in r["reader"]])
    text = _prepare_and_reader(r, prepare, reader)
    if r.get("remote_reader"):
        rows = r["remote_reader"]
        table = format_table(
            ["seq_len", "cache", "open s", "1st batch s", "M tok/s", "samples/s", "MB fetched"],
            [[x["seq_len"], x["cache"], x["open_s"], x["first_batch_s"], x["tokens_per_s"] / 1e6,
              x["samples_per_s"], x["fetched_mb"]] for x in rows])
        text += (f"\nremote reader (http://127.0.0.1 + {rows[0]['latency_ms']:g} ms per request, {rows[0]['shards']} "
                 f"shards, through the shard cache)\n{table}")
    return text


def _prepare_and_reader(r: dict, prepare: str, reader: str) -> str:
    return (f"prepare ({r['corpus_mb']:g} MB JSONL, {r['documents']} docs, vocab {r['vocab']}; tokenizer trained in "
            f"{r['tokenizer_train_s']:.1f}s; identical shards: {r['prepare_identical_1_vs_2_workers']})\n{prepare}\n"
            f"reader (BatchIterator, 1 process, {r['reader_tokens'] / 2**20:.1f} Mi tokens, micro batch "
            f"{r['micro_batch']})\n{reader}")
