"""PackedDataset: memory-mapped token shards of one split, read as windows of seq_len + 1 tokens.

Window i = stream[i*seq_len : i*seq_len + seq_len + 1] (inputs w[:-1], labels w[1:]); consecutive windows
share one boundary token, the incomplete tail is dropped: num_samples = (num_tokens - 1) // seq_len.

Checks on open: manifest format, vocab_size == expected_vocab_size (if given), every shard present with
exactly num_tokens * itemsize bytes, sha256 of every shard (verify_checksums=True; reads all data), and token
ids < vocab_size (verify_tokens: True scans every shard, False none, None (default) only shards up to
VERIFY_SCAN_BYTES, so huge datasets open fast). Independently, every window read is checked for ids >=
vocab_size (one vectorized max per window), so corrupt ids can never reach the embedding.

document_mask=True: batches are `TokenBatch`es carrying per-token document ids derived from EOS
(tapetrain.data.documents); windows themselves are unchanged.

A `path` in object storage (s3://, gs://, hf://, https://; tapetrain.data.remote) reads the manifest remotely and
each shard through the node's cache when first needed (tapetrain.data.remote_shards); a shard is checked against
its sha256 as it is downloaded, so the open-time checks above are skipped for it.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tapetrain.data import format as fmt
from tapetrain.data import remote
from tapetrain.data.cache import ShardCache
from tapetrain.data.documents import DocumentCollate
from tapetrain.data.errors import DataError
from tapetrain.data.remote_shards import RemoteShards

VERIFY_SCAN_BYTES = 64 << 20
REPREPARE = "re-run `tapetrain data prepare` into a fresh directory"


class PackedDataset:
    """Memory-maps one prepared directory's shards of one split and packs the token stream into windows."""

    def __init__(
        self,
        path: str,
        seq_len: int,
        split: str = "train",
        expected_vocab_size: int | None = None,
        verify_checksums: bool = False,
        verify_tokens: bool | None = None,
        document_mask: bool | None = False,
        cache: ShardCache | None = None,
    ):
        if int(seq_len) < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.remote = remote.is_remote(path)
        self.path = path.rstrip("/") if self.remote else os.path.abspath(path)
        self.seq_len, self.split = int(seq_len), split
        self.manifest: dict[str, Any] = fmt.load_manifest(self.path)
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.eos_id: int = self.manifest["eos_id"]
        self.bos_id: int = self.manifest["bos_id"]
        self.document_mask = bool(document_mask)  # None (auto) = off for language modelling
        if self.document_mask and (self.eos_id is None or self.eos_id < 0):
            raise DataError(f"data {path} has no EOS id in its manifest, so document ends are unknown; "
                            "set data.document_mask=false or re-prepare with a tokenizer that has an EOS")
        self.collate = DocumentCollate(self.eos_id) if self.document_mask else None
        if expected_vocab_size is not None and expected_vocab_size != self.vocab_size:
            raise DataError(
                f"data {path} was tokenized with vocab {self.vocab_size} but model.vocab_size is "
                f"{expected_vocab_size}; re-run prepare with the model's tokenizer or set model.vocab_size"
            )
        splits = self.manifest.get("splits", {})
        entry = splits.get(split)
        if not entry or not entry.get("shards"):
            have = [s for s, e in splits.items() if e.get("shards")]
            raise DataError(
                f"data {path} has no {split!r} split (splits with data: {have}); "
                + ("re-run prepare with --val-fraction > 0 (e.g. 0.005) or disable validation"
                   if split == "val" else f"use one of {have}")
            )
        self.dtype = fmt.DTYPES[self.manifest["dtype"]]
        self.shards: list[dict[str, Any]] = entry["shards"]
        self._remote: RemoteShards | None = None
        if self.remote:  # sizes and sha256 are checked as each shard is downloaded
            self._remote = RemoteShards(self.path, self.shards, self.dtype, cache or ShardCache(None, None))
        for shard in self.shards if not self.remote else ():
            self._check_shard(shard, verify_checksums)
        sizes = np.array([s["num_tokens"] for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # (num_shards + 1,) stream offset per shard
        self.num_tokens = int(self._starts[-1])
        self.num_samples = (self.num_tokens - 1) // self.seq_len
        if self.num_samples < 1:
            raise DataError(f"data {path} split {split!r} has {self.num_tokens} tokens, fewer than "
                            f"seq_len + 1 = {self.seq_len + 1}; lower seq_len or prepare more data")
        # ids can only exceed the vocab if the dtype can hold values >= vocab_size
        self._check_ids = self.vocab_size <= np.iinfo(self.dtype).max
        self._maps: list[np.memmap] | None = None
        if self._check_ids and not self.remote:  # remote: only windows as they are read (no download at open)
            for k, shard in enumerate(self.shards):
                if verify_tokens or (verify_tokens is None and shard["num_tokens"] * self.dtype.itemsize
                                     <= VERIFY_SCAN_BYTES):
                    self._verify_ids(self._memmaps()[k], int(self._starts[k]))

    # ------------------------------------------------------------------------------------------- checks
    def _check_shard(self, shard: dict[str, Any], verify_checksums: bool) -> None:
        file = os.path.join(self.path, shard["file"])
        want = shard["num_tokens"] * self.dtype.itemsize
        if not os.path.isfile(file):
            raise DataError(f"shard {file} listed in the manifest is missing; restore it or {REPREPARE}")
        have = os.path.getsize(file)
        if have != want:
            what = "truncated" if have < want else "longer than listed"
            raise DataError(f"shard {shard['file']} is {have} bytes but the manifest lists "
                            f"{shard['num_tokens']} tokens of {self.manifest['dtype']} ({want} bytes): "
                            f"the shard is {what}; {REPREPARE}")
        if verify_checksums:
            digest = fmt.file_sha256(file)
            if digest != shard["sha256"]:
                raise DataError(f"shard {file} has sha256 {digest} but the manifest lists "
                                f"{shard['sha256']}: the file is corrupt; restore it or {REPREPARE}")

    def _verify_ids(self, tokens: np.ndarray, stream_offset: int) -> None:
        """Raise if any id in `tokens` (a slice of the stream starting at stream_offset) is >= vocab_size."""
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            pos = stream_offset + int(np.argmax(tokens >= self.vocab_size))
            k = int(np.searchsorted(self._starts, pos, side="right")) - 1
            with self._shard(k) as shard:
                bad = int(shard[pos - self._starts[k]])
            raise DataError(
                f"shard {self.shards[k]['file']} of {self.path} holds token id {bad} at position "
                f"{pos - self._starts[k]} but vocab_size is {self.vocab_size}: the shard is corrupt or was "
                f"written with another tokenizer; {REPREPARE}"
            )

    # -------------------------------------------------------------------------------------------- reads
    def _memmaps(self) -> list[np.memmap]:
        if self._maps is None:  # opened lazily so pickling (DataLoader workers) does not copy the data
            self._maps = [np.memmap(os.path.join(self.path, s["file"]), dtype=self.dtype, mode="r")
                          for s in self.shards]
        return self._maps

    @contextmanager
    def _shard(self, k: int) -> Iterator[np.ndarray]:
        """Shard k's tokens (a memory map) for the duration of the block."""
        if self._remote is not None:
            with self._remote.use(k) as tokens:
                yield tokens
        else:
            yield self._memmaps()[k]

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard numbers that the windows `indices` read (unique, sorted)."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        first = np.searchsorted(self._starts, starts, side="right") - 1
        last = np.searchsorted(self._starts, starts + self.seq_len, side="right") - 1
        return np.unique(np.concatenate([first, last]))

    @property
    def fetches_remote(self) -> bool:
        return self._remote is not None

    def prefetch(self, indices: np.ndarray) -> None:
        """Fetch in the background what the windows `indices` will read (remote data; a no-op for local)."""
        if self._remote is not None and len(indices):
            self._remote.prefetch(self.shards_of(indices))

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens [start, stop) as int64, across shard boundaries."""
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        if stop <= self._starts[k + 1]:  # common case: inside one shard
            base = int(self._starts[k])
            with self._shard(k) as shard:
                return np.array(shard[start - base:stop - base], dtype=np.int64)  # plain ndarray copy
        out = np.empty(stop - start, dtype=np.int64)
        pos = start
        while pos < stop:
            base, end = int(self._starts[k]), int(min(self._starts[k + 1], stop))
            with self._shard(k) as shard:
                out[pos - start:end - start] = shard[pos - base:end - base]
            pos, k = end, k + 1
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        """Window `index` -> (seq_len + 1,) int64."""
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        window = self.tokens(start, start + self.seq_len + 1)
        if self._check_ids and int(window.max()) >= self.vocab_size:
            self._verify_ids(window, start)
        return window

    def __repr__(self) -> str:
        return (f"PackedDataset({self.path!r}, split={self.split!r}, seq_len={self.seq_len}, "
                f"num_samples={self.num_samples}, num_tokens={self.num_tokens}, "
                f"vocab_size={self.vocab_size})")
