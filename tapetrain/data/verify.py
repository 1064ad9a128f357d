"""`tapetrain data verify DIR`: every shard's sha256 against the manifest and every token id against the vocabulary.

Opening a dataset for training only checks shard sizes (and ids of small shards), because hashing terabytes at
every start is too slow; a flipped byte inside a shard passes that. This reads every byte once (sha256 and the
largest id in the same pass, 4 MiB at a time) with a progress bar, and reports every problem it finds. A dataset in
object storage (a URL) is streamed in ranged reads, without writing it to disk.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import numpy as np

from tapetrain.data import examples, remote
from tapetrain.data import format as fmt
from tapetrain.data.errors import DataError
from tapetrain.progress import progress as progress_bar

BLOCK = 1 << 22  # bytes per read; a multiple of every token width


def verify_dataset(path: str, progress: bool = True) -> list[str]:
    """Problems found in the prepared dataset (or example store) at `path` (empty = every file matches its
    manifest entry)."""
    if examples.is_example_dir(path) and not remote.is_remote(path):
        return _verify_example_store(path, progress)
    manifest = fmt.load_manifest(path)
    dtype = fmt.DTYPES[manifest["dtype"]]
    vocab = int(manifest["vocab_size"])
    shards = [s for split in manifest.get("splits", {}).values() for s in split.get("shards", [])]
    total = sum(s["num_tokens"] * dtype.itemsize for s in shards)
    problems = []
    with progress_bar(total=total, unit="B", unit_scale=True, desc=f"verify {os.path.basename(path.rstrip('/'))}",
                      disable=not progress) as bar:
        for shard in shards:
            problems += _verify_shard(path, shard, dtype, vocab, bar)
    return problems


def _verify_example_store(path: str, progress: bool) -> list[str]:
    """An example store (tapetrain data arith/scrolls): per split, its tokens file (sha256, ids < vocab) and its
    index file (sha256; (num_examples, 3) int64 rows, not token ids)."""
    manifest = examples.read_manifest(path)
    dtype, vocab = examples.DTYPES[manifest["dtype"]], int(manifest["vocab_size"])
    files = []
    for split, entry in manifest["splits"].items():
        sha = entry.get("files", {})
        tokens, index = examples.tokens_file(split), examples.index_file(split)
        files.append(({"file": tokens, "num_tokens": entry["num_tokens"], "sha256": sha.get(tokens)}, dtype, vocab))
        files.append(({"file": index, "num_tokens": 3 * entry["num_examples"], "sha256": sha.get(index)},
                      np.dtype("<i8"), None))
    total = sum(f["num_tokens"] * d.itemsize for f, d, _ in files)
    problems = []
    with progress_bar(total=total, unit="B", unit_scale=True, desc=f"verify {os.path.basename(path)}",
                      disable=not progress) as bar:
        for file, file_dtype, file_vocab in files:
            problems += _verify_shard(path, file, file_dtype, file_vocab, bar)
    return problems


def _verify_shard(root: str, shard: dict, dtype: np.dtype, vocab: int | None, bar) -> list[str]:
    """Size, sha256 and (when `vocab` is given) token ids < vocab of one file listed in a manifest."""
    want = shard["num_tokens"] * dtype.itemsize
    size = _size(root, shard["file"])
    if size is None:
        bar.update(want)
        return [f"{shard['file']}: missing"]
    problems = [] if size == want else [f"{shard['file']}: {size} bytes, the manifest lists {want}"]
    digest, largest, first_bad = hashlib.sha256(), -1, None
    offset = 0
    for block in _blocks(root, shard["file"], size):
        digest.update(block)
        ids = np.frombuffer(block[: len(block) - len(block) % dtype.itemsize], dtype=dtype)
        if len(ids) and vocab is not None:
            top = int(ids.max())
            if top >= vocab and first_bad is None:
                first_bad = offset + int(np.argmax(ids >= vocab))
            largest = max(largest, top)
        offset += len(ids)
        bar.update(len(block))
    if size < want:
        bar.update(want - size)
    if digest.hexdigest() != shard.get("sha256"):
        problems.append(f"{shard['file']}: sha256 {digest.hexdigest()} but the manifest lists {shard.get('sha256')}"
                        " (the file changed after prepare wrote it)")
    if first_bad is not None:
        problems.append(f"{shard['file']}: token id {largest} >= vocab_size {vocab} (first at token {first_bad})")
    return problems


def _size(root: str, name: str) -> int | None:
    """Bytes of file `name` of the dataset at `root` (a directory or a URL), None if it does not exist."""
    if remote.is_remote(root):
        fs, path = remote.filesystem(remote.join(root, name))
        try:
            return int(fs.size(path))
        except FileNotFoundError:
            return None
    file = os.path.join(root, name)
    return os.path.getsize(file) if os.path.isfile(file) else None


def _blocks(root: str, name: str, size: int) -> Iterator[bytes]:
    """The file's bytes, BLOCK at a time (ranged reads for a URL)."""
    if remote.is_remote(root):
        url = remote.join(root, name)
        for start in range(0, size, BLOCK):
            yield remote.read_bytes(url, start, min(start + BLOCK, size))
        return
    with open(os.path.join(root, name), "rb") as f:
        while block := f.read(BLOCK):
            yield block


def require_verified(paths: list[str], progress: bool = True) -> None:
    """Raise DataError listing every problem of every dataset in `paths` (data.verify at the start of a run)."""
    found = [f"{p}/{problem}" for p in paths for problem in verify_dataset(p, progress)]
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise DataError(f"data.verify: {len(found)} problem(s) in the training data: {shown}. Restore the files from "
                        "a good copy or re-run `tapetrain data prepare` into a fresh directory")
