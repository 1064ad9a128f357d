"""Benchmark the data layer: `prepare` throughput at 1 and 2 workers and BatchIterator read throughput.

    python tools/bench_data.py --out bench_data.json

Steps (all in a temp dir unless --workdir): generate a synthetic corpus (Zipf-distributed pseudo-words,
--corpus-mb MB of JSONL), train a --vocab tokenizer on it, run prepare with 1 and 2 workers (checking the
shards are identical), then write a synthetic --reader-tokens token dataset and time BatchIterator over it
for --seconds per sequence length. Reader figures are tokens (seq_len per sample) per second in one process,
with the shards in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from tapetrain.data import format as fmt
from tapetrain.data.prepare import prepare
from tapetrain.data.tokenizer import train_tokenizer


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
            text = " ".join(words[i] for i in ids)
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def write_synthetic_dataset(out_dir: str, template: dict, num_tokens: int, shard_tokens: int) -> None:
    """Random ids < vocab in prepare's layout; the manifest of a real run provides all but the splits."""
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
    # imported here: spawned prepare workers re-import this script, and torch would slow their start-up
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write results as JSON here")
    parser.add_argument("--workdir", help="keep generated data here (default: a temp dir, removed)")
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--reader-tokens", type=int, default=64 << 20)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="bench_data_")
    os.makedirs(work, exist_ok=True)
    results: dict = {"cpu_count": os.cpu_count(), "corpus_mb": args.corpus_mb, "vocab": args.vocab}
    try:
        corpus = os.path.join(work, "corpus.jsonl")
        results["documents"] = make_corpus(corpus, args.corpus_mb)
        t0 = time.perf_counter()
        tok = train_tokenizer([corpus], args.vocab, os.path.join(work, "tok.model"), max_sentences=200_000)
        results["tokenizer_train_s"] = time.perf_counter() - t0

        results["prepare"] = []
        for workers in (1, 2):
            out = os.path.join(work, f"prep_w{workers}")
            t0 = time.perf_counter()
            manifest = prepare([corpus], tok, out, workers=workers, overwrite=True, progress=False)
            dt = time.perf_counter() - t0
            results["prepare"].append({"workers": workers, "seconds": dt, "tokens": manifest["num_tokens"],
                                       "tokens_per_s": manifest["num_tokens"] / dt,
                                       "docs_per_s": manifest["num_documents"] / dt,
                                       "mb_per_s": args.corpus_mb / dt})
        same = all(open(os.path.join(work, "prep_w1", s["file"]), "rb").read()
                   == open(os.path.join(work, "prep_w2", s["file"]), "rb").read()
                   for s in manifest["splits"]["train"]["shards"])
        results["prepare_identical_1_vs_2_workers"] = same

        synth = os.path.join(work, "synthetic")
        write_synthetic_dataset(synth, manifest, args.reader_tokens, shard_tokens=args.reader_tokens // 4 + 1)
        results["reader"] = [bench_reader(synth, L, args.micro_batch, args.seconds) for L in args.seq_lens]
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print(f"prepare ({args.corpus_mb:g} MB JSONL, {results['documents']} docs, vocab {args.vocab}; tokenizer "
          f"trained in {results['tokenizer_train_s']:.1f}s; identical shards: {same})")
    print(f"  {'workers':>7} {'seconds':>8} {'M tok/s':>8} {'docs/s':>9} {'MB/s':>6}")
    for r in results["prepare"]:
        print(f"  {r['workers']:>7} {r['seconds']:>8.2f} {r['tokens_per_s'] / 1e6:>8.2f} "
              f"{r['docs_per_s']:>9.0f} {r['mb_per_s']:>6.2f}")
    print(f"reader (BatchIterator, 1 process, {args.reader_tokens / 2**20:.0f} Mi tokens, micro batch "
          f"{args.micro_batch})")
    print(f"  {'seq_len':>7} {'open s':>7} {'M tok/s':>8} {'samples/s':>10}")
    for r in results["reader"]:
        print(f"  {r['seq_len']:>7} {r['open_s']:>7.2f} {r['tokens_per_s'] / 1e6:>8.1f} "
              f"{r['samples_per_s']:>10.0f}")
    if args.out:
        fmt.write_json_atomic(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
