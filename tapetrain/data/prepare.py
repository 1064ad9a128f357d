"""Tokenize a corpus into fixed-size token shards plus manifest.json (layout: tapetrain.data.format).

Determinism: documents are read in input order (globs sorted) and numbered 0, 1, 2, ...; tokenizing runs in
`workers` processes on chunks of documents whose results are consumed strictly in submission order, so the
shards are byte-identical for any number of workers. Document i goes to "val" iff
uniform01(i, seed) < val_fraction (a counter-based hash, tapetrain.data.hashing), else to "train".
With split_docs_at, documents are cut into pieces of at most that many tokens first, and piece j of document i
goes to "val" iff uniform01((i << 32) | j, seed, stream=1) < val_fraction. A val split asked for but left empty is
an error (DataError naming --split-docs-at), not a dataset without val.

Writing: everything goes into a hidden sibling directory `.OUT.prepare.tmp` (same filesystem), which replaces
OUT only once the manifest is written; so a bad input, a crash or Ctrl-C never touches an existing OUT, and
`--overwrite` keeps the old dataset readable until the new one is complete (both exist on disk for a moment).
Files in OUT that prepare did not write are carried over into the new OUT.

Re-running into the same directory:
  * a finished run (manifest.json present) is never overwritten unless --overwrite;
  * a killed run of an older tapetrain (the `.prepare-incomplete` marker, or shards without a manifest in OUT)
    is not resumed: prepare refuses and asks to delete the directory or pass --overwrite.
A run failing with an exception removes its temporary directory; one killed outright leaves it, and the next run
removes it. If a run is killed between the two renames of the swap, the previous dataset is in `.OUT.prepare-old`.
"""

from __future__ import annotations

import ctypes
import glob
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from tapetrain import atomic_io
from tapetrain.data import format as fmt
from tapetrain.data import publish, remote
from tapetrain.data.errors import DataError
from tapetrain.data.hashing import uniform01
from tapetrain.data.sources import SourceStats, expand_inputs, iter_documents
from tapetrain.data.tokenizer import open_tokenizer, write_copy
from tapetrain.progress import progress as progress_bar

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 27  # 128Mi tokens: 256 MiB per uint16 shard
TOKENIZER_COPY = "tokenizer"  # the directory of a dataset (and of a run) that holds a copy of its tokenizer
CHUNK_DOCS = 512  # documents per worker task ...
CHUNK_CHARS = 1 << 20  # ... or fewer if they already hold this many characters

Chunk = tuple[int, list[str]]  # (index of the first document, texts)
# (train tokens, train doc lengths, val tokens, val doc lengths); lengths include the EOS
Encoded = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class ChunkEncoder:
    """Tokenizes a chunk, appends EOS, and splits documents into train/val by their global index.

    With split_at, a document is first cut into pieces of at most split_at tokens; each piece is a document of its
    own (its own EOS and its own train/val draw, keyed by (document index, piece index)).
    """

    def __init__(self, tokenizer_path: str, dtype: str, seed: int, val_fraction: float, split_at: int | None = None,
                 eos_token: str | None = None):
        self.tok = open_tokenizer(tokenizer_path, eos_token)
        self.dtype = fmt.DTYPES[dtype]
        self.seed, self.val_fraction, self.split_at = seed, val_fraction, split_at

    def __call__(self, chunk: Chunk) -> Encoded:
        start, texts = chunk
        ids = self.tok.encode_batch(texts)
        if self.split_at is None:
            is_val = uniform01(np.arange(start, start + len(texts)), self.seed) < self.val_fraction
        else:
            ids, keys = _split_pieces(ids, start, self.split_at)
            is_val = uniform01(keys, self.seed, stream=1) < self.val_fraction
        eos = self.tok.eos_id
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.empty(int(lengths.sum()), dtype=self.dtype)
        pos = 0
        for x in ids:  # (sum(lengths),) stream: doc0 ids, EOS, doc1 ids, EOS, ...
            flat[pos:pos + len(x)] = x
            flat[pos + len(x)] = eos
            pos += len(x) + 1
        if not is_val.any():
            empty = np.empty(0, dtype=self.dtype)
            return flat, lengths, empty, np.empty(0, dtype=np.int64)
        doc_of_token = np.repeat(is_val, lengths)
        return flat[~doc_of_token], lengths[~is_val], flat[doc_of_token], lengths[is_val]


def _split_pieces(ids: list[list[int]], start: int, split_at: int) -> tuple[list[list[int]], np.ndarray]:
    """Pieces of at most split_at tokens and their keys (document index << 32 | piece index): a piece's train/val
    draw depends on its place in the corpus only, not on chunking or workers."""
    pieces: list[list[int]] = []
    keys: list[int] = []
    for i, doc in enumerate(ids):
        for j, at in enumerate(range(0, max(len(doc), 1), split_at)):
            pieces.append(doc[at:at + split_at])
            keys.append(((start + i) << 32) | j)
    return pieces, np.array(keys, dtype=np.uint64)


_worker_encoder: ChunkEncoder | None = None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies, however it dies: a SIGKILLed prepare otherwise
    leaves its workers blocked on their task queue for good, holding memory and CPU (Linux only; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): workers may outlive a killed prepare",
                    ctypes.get_errno())
    if os.getppid() != parent:  # the parent died before prctl: the signal will never come
        os._exit(1)


def _init_worker(parent: int, encoder_args: tuple) -> None:
    global _worker_encoder
    _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, as sentencepiece's num_threads=1
    _worker_encoder = ChunkEncoder(*encoder_args)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _worker_encoder is not None
    return _worker_encoder(chunk)


def _chunks(docs: Iterable[str]) -> Iterator[Chunk]:
    texts: list[str] = []
    chars, start = 0, 0
    for text in docs:
        texts.append(text)
        chars += len(text)
        if len(texts) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield start, texts
            start += len(texts)
            texts, chars = [], 0
    if texts:
        yield start, texts


def _encode_all(chunks: Iterator[Chunk], encoder_args: tuple, workers: int) -> Iterator[tuple[int, Encoded]]:
    """Yield (num_docs, encoded) per chunk, in input order.

    With workers > 1 a bounded window of tasks is kept in flight (not Pool.imap, whose feeder thread would
    read the whole corpus into memory ahead of the tokenizers). ProcessPoolExecutor rather than Pool because
    a worker dying at start-up raises BrokenProcessPool instead of hanging in a respawn loop.
    """
    if workers == 1:
        encoder = ChunkEncoder(*encoder_args)
        for chunk in chunks:
            yield len(chunk[1]), encoder(chunk)
        return
    # spawn: the parent may hold threads (torch, tqdm) that make fork unsafe.
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(os.getpid(), encoder_args)) as pool:
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append((len(chunk[1]), pool.submit(_encode_in_worker, chunk)))
                if len(pending) >= 2 * workers:
                    n, future = pending.popleft()
                    yield n, future.result()
            while pending:
                n, future = pending.popleft()
                yield n, future.result()
        finally:
            for _, future in pending:  # on error/interrupt: do not tokenize the rest
                future.cancel()


def _own_files(out_dir: str) -> list[str]:
    patterns = [f"{split}-[0-9]*.bin" for split in fmt.SPLITS] + [".*.tmp"]
    return sorted(p for pat in patterns for p in glob.glob(os.path.join(out_dir, pat)))


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse to replace a finished or interrupted run unless overwrite; touches nothing."""
    manifest = os.path.join(out_dir, fmt.MANIFEST)
    marker = os.path.join(out_dir, fmt.INCOMPLETE_MARKER)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"--out {out_dir} is a file, not a directory; choose another --out")
    if overwrite or not os.path.isdir(out_dir):
        return
    if os.path.exists(marker) or (_own_files(out_dir) and not os.path.exists(manifest)):
        raise DataError(f"out dir {out_dir} contains an incomplete prepare run (resuming is not "
                        "supported); delete it or pass --overwrite to start over")
    if os.path.exists(manifest):
        raise DataError(f"out dir {out_dir} already holds a prepared dataset ({fmt.MANIFEST}); choose "
                        "another --out or pass --overwrite to replace it")


def _sibling(out_dir: str, suffix: str) -> str:
    parent, name = os.path.split(out_dir)
    return os.path.join(parent, f".{name}.{suffix}")


def _start_work_dir(out_dir: str) -> str:
    """A fresh hidden sibling of out_dir to write into (a leftover of a killed run is removed first)."""
    work = _sibling(out_dir, "prepare.tmp")
    marker = os.path.join(work, fmt.INCOMPLETE_MARKER)
    if os.path.isdir(work):
        try:
            with open(marker) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = None
        if pid is not None and pid != os.getpid() and _alive(pid):
            raise DataError(f"another prepare (pid {pid}) is writing {out_dir} (into {work}); wait for it or stop it")
        shutil.rmtree(work)
    os.makedirs(work)
    atomic_io.write_json(marker, {"pid": os.getpid(), "started": time.time()})
    return work


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _install(work: str, out_dir: str) -> None:
    """Put the finished dataset in `work` at out_dir, replacing prepare's files there and keeping any others."""
    os.remove(os.path.join(work, fmt.INCOMPLETE_MARKER))
    old = atomic_io.publish_dir(work, out_dir, _sibling(out_dir, "prepare-old"), remove_aside=False)
    if old is None:
        return
    own = {os.path.basename(p) for p in _own_files(old)} | {fmt.MANIFEST, fmt.INCOMPLETE_MARKER}
    for name in os.listdir(old):
        if name not in own and not os.path.exists(os.path.join(out_dir, name)):
            shutil.move(os.path.join(old, name), os.path.join(out_dir, name))  # the user's own, not written here
    shutil.rmtree(old)


def _write_shards(sources: list[str], tok, dtype: str, out_dir: str, text_key: str,
                  val_fraction: float, workers: int, shard_tokens: int, skip_bad: bool, seed: int,
                  progress: bool, stats: SourceStats, split_at: int | None = None,
                  eos_token: str | None = None) -> dict[str, Any]:
    """Read, tokenize and shard everything; return the manifest's "splits" entry."""
    writers = {split: fmt.ShardWriter(out_dir, split, dtype, shard_tokens) for split in fmt.SPLITS}
    docs = (doc.text for doc in iter_documents(sources, text_key=text_key, skip_bad=skip_bad, stats=stats))
    bar = progress_bar(desc="prepare", unit="doc", unit_scale=True, disable=not progress)
    t0, tokens = time.perf_counter(), 0
    with bar:
        encoded = _encode_all(_chunks(docs), (tok.path, dtype, seed, val_fraction, split_at, eos_token), workers)
        for ndocs, (tr, tr_len, va, va_len) in encoded:
            writers["train"].add(tr, tr_len)
            writers["val"].add(va, va_len)
            tokens += len(tr) + len(va)
            bar.update(ndocs)
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{rate / 1e6:.2f}M tok/s", refresh=False)
    splits = {split: w.close() for split, w in writers.items()}
    if splits["train"]["num_tokens"] == 0:
        raise DataError(f"no document landed in the train split (val_fraction={val_fraction}); lower "
                        "--val-fraction or add documents")
    if val_fraction > 0 and splits["val"]["num_tokens"] == 0:
        raise DataError(_empty_val_message(val_fraction, splits["train"]["num_documents"], split_at))
    return splits


def _empty_val_message(val_fraction: float, documents: int, split_at: int | None) -> str:
    cut = (f"pass a smaller --split-docs-at than {split_at}" if split_at else
           "pass --split-docs-at 2048 to cut documents into pieces of at most 2048 tokens")
    return (f"--val-fraction {val_fraction} put no document into the val split ({documents} document(s) in all: a "
            f".txt file is one document, a JSON line or parquet row is one); add more input files, {cut}, or set "
            "--val-fraction 0")


def prepare(
    inputs: str | list[str],
    tokenizer_path: str,
    out_dir: str,
    text_key: str = "text",
    val_fraction: float = 0.0,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    skip_bad: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    split_docs_at: int | None = None,
    eos_token: str | None = None,
) -> dict[str, Any]:
    """Tokenize `inputs` (globs or hf:NAME[:CONFIG][:SPLIT]) into shards in `out_dir`; return the manifest.

    Every document gets one EOS appended (counted in num_tokens). Bad records raise DataError naming file and
    line unless skip_bad, in which case they are counted (manifest "skipped_records") and logged at the end.
    See the module docstring for determinism and re-run behaviour. `eos_token` names the EOS of a tokenizer.json
    whose config files name none; the dataset's tokenizer copy then carries it (a tokenizer_config.json).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}; e.g. 0.005")
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if split_docs_at is not None and split_docs_at < 1:
        raise DataError(f"--split-docs-at must be >= 1 token, got {split_docs_at}; e.g. 2048 (or leave it out)")
    tok = open_tokenizer(tokenizer_path, eos_token)
    if tok.eos_id < 0:
        raise DataError(f"tokenizer {tokenizer_path} has no EOS id; prepare separates documents with EOS: name "
                        "the tokenizer's end-of-text token with --eos-token (e.g. --eos-token '<|endoftext|>'), or use "
                        "a tokenizer.json whose tokenizer_config.json names an eos_token, or a sentencepiece model "
                        "trained with eos_id >= 0 (e.g. `tapetrain data tokenizer`)")
    dtype = fmt.token_dtype(tok.vocab_size)
    sources = expand_inputs(inputs)  # fail on bad globs before touching out_dir
    if remote.is_remote(out_dir):  # object storage: write locally, upload, verify (tapetrain.data.publish)
        publish.check_destination(out_dir, overwrite)
        with tempfile.TemporaryDirectory(prefix="tapetrain-prepare-") as tmp:
            local = os.path.join(tmp, "data")
            manifest = prepare(sources, tokenizer_path, local, text_key, val_fraction, workers, shard_tokens,
                               skip_bad, seed, overwrite=False, progress=progress, split_docs_at=split_docs_at,
                               eos_token=eos_token)
            publish.publish(local, out_dir, progress=progress)
        return manifest
    out_dir = os.path.abspath(out_dir)
    _check_out_dir(out_dir, overwrite)
    work = _start_work_dir(out_dir)

    stats = SourceStats()
    try:
        splits = _write_shards(sources, tok, dtype, work, text_key, val_fraction, workers, shard_tokens,
                               skip_bad, seed, progress, stats, split_docs_at, eos_token)
    except BaseException:  # bad input, Ctrl-C, worker crash: out_dir was never touched; drop the work dir
        shutil.rmtree(work, ignore_errors=True)
        raise
    # A copy of the tokenizer travels with the shards: a run adopts it even where `tok.path` does not exist. With
    # an EOS named on the command line only the copy is a complete tokenizer (its tokenizer_config.json names the
    # EOS), so the manifest names the copy: the run adopts it, keeps it and exports it with its EOS.
    copy = write_copy(tok, os.path.join(work, TOKENIZER_COPY))
    named = getattr(tok, "eos_named", False)
    manifest = {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "tokenizer": {"path": os.path.join(out_dir, os.path.relpath(copy, work)) if named else tok.path,
                      "sha256": tok.checksum, "kind": tok.kind,
                      "copy": f"{TOKENIZER_COPY}/{os.path.basename(tok.path)}"},
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "inputs": sources,
        "text_key": text_key,
        "val_fraction": val_fraction,
        "split_docs_at": split_docs_at,
        "seed": seed,
        "shard_tokens": shard_tokens,
        "num_tokens": sum(s["num_tokens"] for s in splits.values()),
        "num_documents": sum(s["num_documents"] for s in splits.values()),
        "skipped_records": stats.skipped,
        "empty_documents": stats.empty,
        "splits": splits,
    }
    atomic_io.write_json(os.path.join(work, fmt.MANIFEST), manifest)
    _install(work, out_dir)
    log.info("prepare: %s; %d tokens", stats.summary(), manifest["num_tokens"])
    if stats.skipped:
        log.warning("prepare skipped %d bad records (first: %s)", stats.skipped, " | ".join(stats.examples))
    return manifest
