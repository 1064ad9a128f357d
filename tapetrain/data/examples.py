"""On-disk store of supervised examples: (prompt, answer) token ids, written by `tapetrain data arith` and
`tapetrain data scrolls`, read by the trainer through `tapetrain.data.supervised`.

A store directory holds, per split:
  {split}.tokens.bin   every example's prompt ids followed by its answer ids (the answer ends with EOS), back to
                       back; raw little-endian uint8/uint16/uint32 (the smallest that holds the vocabulary)
  {split}.index.bin    int64 (num_examples, 3): start offset in the tokens file, prompt length, answer length
plus `tokenizer.model` (a copy, so the directory is self-contained) and `manifest.json`, written last. The whole
directory is built under a temporary name next to its destination and renamed into place, so a crashed or killed
writer never leaves a directory that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tapetrain import atomic_io
from tapetrain.data.errors import DataError
from tapetrain.data.format import file_sha256

FORMAT_NAME = "tapetrain.examples"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"
DTYPES = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
FLUSH_TOKENS = 1 << 22  # buffered tokens before a write


def example_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokens_file(split: str) -> str:
    return f"{split}.tokens.bin"


def index_file(split: str) -> str:
    return f"{split}.index.bin"


class ExampleWriter:
    """Appends one split's examples to its tokens and index files; close() returns the manifest entry."""

    def __init__(self, out_dir: str, split: str, vocab_size: int):
        self.out_dir, self.split, self.vocab_size = out_dir, split, vocab_size
        self.dtype = DTYPES[example_dtype(vocab_size)]
        self._tokens = open(os.path.join(out_dir, tokens_file(split)), "wb")
        self._index = open(os.path.join(out_dir, index_file(split)), "wb")
        self._hash = {tokens_file(split): hashlib.sha256(), index_file(split): hashlib.sha256()}
        self._buf_tokens: list[np.ndarray] = []
        self._buf_index: list[np.ndarray] = []
        self._buffered = 0
        self.num_examples = self.num_tokens = self.answer_tokens = self.max_length = 0

    def add(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """One example; `answer` already ends with EOS."""
        ids = np.asarray(list(prompt) + list(answer), dtype=np.int64)
        self.add_batch(ids, np.array([len(prompt)]), np.array([len(answer)]))

    def add_batch(self, tokens: np.ndarray, prompt_lens: np.ndarray, answer_lens: np.ndarray) -> None:
        """Many examples at once: `tokens` is their concatenation (prompt, answer, prompt, answer, ...)."""
        lengths = np.asarray(prompt_lens, np.int64) + np.asarray(answer_lens, np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but the lengths add up to {int(lengths.sum())}")
        if len(lengths) == 0:
            return
        if np.any(np.asarray(answer_lens) < 1):
            raise DataError("an example has an empty answer: every answer needs at least its EOS token")
        if len(tokens) and (int(np.min(tokens)) < 0 or int(np.max(tokens)) >= self.vocab_size):
            raise DataError(f"token ids outside [0, {self.vocab_size}): the tokenizer and vocab_size disagree")
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        index = np.stack([starts, np.asarray(prompt_lens, np.int64), np.asarray(answer_lens, np.int64)], axis=1)
        self._buf_tokens.append(np.asarray(tokens, dtype=self.dtype))
        self._buf_index.append(index.astype("<i8"))
        self.num_examples += len(lengths)
        self.num_tokens += len(tokens)
        self.answer_tokens += int(np.sum(answer_lens))
        self.max_length = max(self.max_length, int(lengths.max()))
        self._buffered += len(tokens)
        if self._buffered >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for parts, handle, name in ((self._buf_tokens, self._tokens, tokens_file(self.split)),
                                    (self._buf_index, self._index, index_file(self.split))):
            if parts:
                data = np.concatenate(parts).tobytes()
                handle.write(data)
                self._hash[name].update(data)
                parts.clear()
        self._buffered = 0

    def close(self) -> dict[str, Any]:
        self._flush()
        self._tokens.close()
        self._index.close()
        if self.num_examples == 0:
            raise DataError(f"split {self.split!r} received no example; check the input")
        return {
            "num_examples": self.num_examples,
            "num_tokens": self.num_tokens,
            "answer_tokens": self.answer_tokens,
            "max_length": self.max_length,
            "files": {name: h.hexdigest() for name, h in self._hash.items()},
        }


@contextlib.contextmanager
def example_dir_writer(out_dir: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory next to `out_dir` to build a store in; on success it replaces `out_dir`.

    An existing `out_dir` is refused unless `overwrite`; an exception removes the temporary directory, so a
    failed build changes nothing."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise DataError(f"--out {out_dir} already exists; choose another --out or pass --overwrite to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        if not os.path.isfile(os.path.join(tmp, MANIFEST)):
            raise RuntimeError("internal error: the example store was built without a manifest")
        atomic_io.publish_dir(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(out_dir: str, *, vocab_size: int, bos_id: int, eos_id: int, pad_id: int,
                   splits: dict[str, dict], task: dict[str, Any], tokenizer_source: str | None,
                   tokenizer_file: str = TOKENIZER_FILE) -> dict:
    """manifest.json of a store (call last, after the splits are closed and the tokenizer file is in place:
    tokenizer.model, or a Hugging Face tokenizer's tokenizer.json and its config files)."""
    tok_path = os.path.join(out_dir, tokenizer_file)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "vocab_size": int(vocab_size),
        "dtype": example_dtype(vocab_size),
        "bos_id": int(bos_id),
        "eos_id": int(eos_id),
        "pad_id": int(pad_id),
        "tokenizer": {"file": tokenizer_file, "sha256": file_sha256(tok_path), "source": tokenizer_source},
        "task": task,
        "splits": splits,
    }
    atomic_io.write_json(os.path.join(out_dir, MANIFEST), manifest)
    return manifest


def is_example_dir(path: str) -> bool:
    """Whether `path` is a store written by this module (vs token shards of `tapetrain data prepare`)."""
    from tapetrain.data import remote

    if remote.is_remote(path):
        try:
            found = remote.read_json(remote.join(path, MANIFEST))
        except DataError:
            return False  # load_manifest reports the missing manifest
        return isinstance(found, dict) and found.get("format") == FORMAT_NAME
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return False
    try:
        with open(manifest, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT_NAME
    except (OSError, ValueError):
        return False


def read_manifest(path: str) -> dict[str, Any]:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise DataError(f"{path} has no {MANIFEST}: not an example store; write one with `tapetrain data arith` "
                        "or `tapetrain data scrolls`")
    with open(mpath, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{mpath} has format {manifest.get('format')!r} version {manifest.get('version')!r}; this "
                        f"tapetrain reads {FORMAT_NAME!r} version {FORMAT_VERSION}; rebuild the data")
    return manifest


def tokenizer_of(path: str) -> str | None:
    """The tokenizer file of an example store (None for anything else)."""
    if not is_example_dir(path):
        return None
    name = (read_manifest(path).get("tokenizer") or {}).get("file") or TOKENIZER_FILE
    tok = os.path.join(os.path.abspath(path), name)
    return tok if os.path.isfile(tok) else None


class ExampleStore:
    """Memory-mapped examples of one split: example(i) -> (ids (n,) int64, prompt length)."""

    def __init__(self, path: str, split: str = "train", expected_vocab_size: int | None = None):
        self.path, self.split = os.path.abspath(path), split
        self.manifest = read_manifest(self.path)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.bos_id, self.eos_id = self.manifest["bos_id"], self.manifest["eos_id"]
        self.pad_id = self.manifest["pad_id"] if self.manifest["pad_id"] >= 0 else self.eos_id
        if expected_vocab_size is not None and expected_vocab_size != self.vocab_size:
            raise DataError(f"examples {path} were tokenized with vocab {self.vocab_size} but model.vocab_size is "
                            f"{expected_vocab_size}; set model.vocab_size: {self.vocab_size} or rebuild the data "
                            "with the model's tokenizer")
        entry = self.manifest["splits"].get(split)
        if not entry:
            raise DataError(f"examples {path} have no {split!r} split (have: {sorted(self.manifest['splits'])}); "
                            + ("leave data.val empty or build a val split" if split == "val" else "rebuild the data"))
        self.num_examples, self.max_length = int(entry["num_examples"]), int(entry["max_length"])
        self.dtype = DTYPES[self.manifest["dtype"]]
        for name, size in ((tokens_file(split), entry["num_tokens"] * self.dtype.itemsize),
                           (index_file(split), self.num_examples * 24)):
            file = os.path.join(self.path, name)
            if not os.path.isfile(file) or os.path.getsize(file) != size:
                have = os.path.getsize(file) if os.path.isfile(file) else "missing"
                raise DataError(f"{file} should hold {size} bytes but is {have}: the store is damaged; rebuild it")
        self._maps: tuple[np.memmap, np.memmap] | None = None

    def _memmaps(self) -> tuple[np.memmap, np.memmap]:
        if self._maps is None:  # lazily, so pickling (worker processes) never copies the data
            tokens = np.memmap(os.path.join(self.path, tokens_file(self.split)), dtype=self.dtype, mode="r")
            index = np.memmap(os.path.join(self.path, index_file(self.split)), dtype="<i8", mode="r")
            self._maps = tokens, index.reshape(-1, 3)
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    @property
    def index(self) -> np.ndarray:
        """(num_examples, 3) int64: start, prompt length, answer length."""
        return self._memmaps()[1]

    def lengths(self) -> np.ndarray:
        """(num_examples,) total tokens per example."""
        return np.asarray(self.index[:, 1] + self.index[:, 2], dtype=np.int64)

    def example(self, i: int) -> tuple[np.ndarray, int]:
        tokens, index = self._memmaps()
        start, prompt_len, answer_len = (int(v) for v in index[i])
        return np.array(tokens[start:start + prompt_len + answer_len], dtype=np.int64), prompt_len

    def __len__(self) -> int:
        return self.num_examples
