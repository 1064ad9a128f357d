"""On-disk layout of a prepared dataset: token shards, manifest.json and the in-progress marker.

A prepared directory holds, per split ("train", "val"), shards `{split}-{i:05d}.bin` of raw little-endian
uint16 token ids (uint32 when vocab_size > 65536), no header. Every shard except the last of a split holds
exactly `shard_tokens` tokens; documents run across shard boundaries, each followed by one EOS. The split's
token stream is the concatenation of its shards in order. `manifest.json` (written last) describes it all;
`.prepare-incomplete` exists while a prepare run is writing, so a crashed run is recognisable.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shlex
from typing import Any

import numpy as np

from tapetrain import atomic_io
from tapetrain.data.errors import DataError

FORMAT_NAME = "tapetrain.tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INCOMPLETE_MARKER = ".prepare-incomplete"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def file_sha256(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWriter:
    """Cuts one split's token stream into fixed-size shards as tokens arrive.

    add(tokens (n,), doc_lengths (d,)) appends whole documents (EOS included, sum(doc_lengths) == n);
    a document is counted in the shard holding its last token. close() writes the tail shard and returns the
    split entry of the manifest.
    """

    def __init__(self, out_dir: str, split: str, dtype: str, shard_tokens: int):
        if shard_tokens < 1:
            raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.dtype = DTYPES[dtype]
        self._buf: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []  # absolute stream positions one past each document's EOS
        self._total = 0  # tokens added
        self._written = 0  # tokens in completed shards
        self.shards: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        if len(tokens) == 0:
            return
        self._buf.append(np.asarray(tokens, dtype=self.dtype))
        self._ends.append(self._total + np.cumsum(doc_lengths, dtype=np.int64))
        self._total += len(tokens)
        while self._total - self._written >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> dict[str, Any]:
        if self._total > self._written:
            self._flush(self._total - self._written)
        return {
            "num_tokens": self._written,
            "num_documents": sum(s["num_documents"] for s in self.shards),
            "shards": self.shards,
        }

    def _flush(self, n: int) -> None:
        stream = np.concatenate(self._buf) if len(self._buf) > 1 else self._buf[0]
        shard, rest = stream[:n], stream[n:]
        self._buf = [rest] if len(rest) else []
        ends = np.concatenate(self._ends) if len(self._ends) > 1 else self._ends[0]
        ndocs = int(np.searchsorted(ends, self._written + n, side="right"))
        self._ends = [ends[ndocs:]] if ndocs < len(ends) else []
        name = shard_name(self.split, len(self.shards))
        data = np.ascontiguousarray(shard).tobytes()
        atomic_io.write_bytes(os.path.join(self.out_dir, name), data)
        self.shards.append({"file": name, "num_tokens": int(n), "num_documents": ndocs,
                            "sha256": hashlib.sha256(data).hexdigest()})
        self._written += n


def _load_remote_manifest(url: str) -> dict[str, Any]:
    """manifest.json of a dataset in object storage (uploaded last by prepare, so no incomplete marker)."""
    from tapetrain.data import remote

    mpath = remote.join(url, MANIFEST)
    try:
        return remote.read_json(mpath)
    except DataError as err:
        if "does not exist" in str(err):
            raise DataError(f"data path {url} has no {MANIFEST} ({mpath} not found): it is not a prepared dataset; "
                            f"upload one with `tapetrain data prepare --out {url}` or fix the URL") from err
        raise


def prepare_hint(path: str, overwrite: bool = False) -> str:
    """The command that prepares `path` (--overwrite where prepare's leftovers are there), as a user types it."""
    return (f"`tapetrain data prepare --input CORPUS --tokenizer TOKENIZER --out {shlex.quote(path)}"
            f"{' --overwrite' if overwrite else ''}` (CORPUS: your .jsonl/.txt files, TOKENIZER: a tokenizer.model "
            "or tokenizer.json)")


def load_manifest(path: str) -> dict[str, Any]:
    """Read and sanity-check `path`/manifest.json of a finished prepare run (a local path or a URL)."""
    from tapetrain.data.remote import is_remote

    if is_remote(path):
        return _check_manifest(_load_remote_manifest(path), f"{path.rstrip('/')}/{MANIFEST}")
    if not os.path.isdir(path):
        raise DataError(f"data path {path} does not exist or is not a directory; fix the data path, or prepare it: "
                        f"{prepare_hint(path)}")
    if os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
        raise DataError(f"data path {path} holds an incomplete prepare run (it was interrupted); prepare it again: "
                        f"{prepare_hint(path, overwrite=True)}")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        if any(glob.glob(os.path.join(path, f"{split}-[0-9]*.bin")) for split in SPLITS):
            raise DataError(f"data path {path} holds token shards but no {MANIFEST} (an interrupted prepare run, or "
                            f"the manifest was removed); prepare it again: {prepare_hint(path, overwrite=True)}")
        raise DataError(f"data path {path} has no {MANIFEST}: it is not a prepared dataset; prepare it: "
                        f"{prepare_hint(path)}")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{mpath} is not valid JSON ({err}); re-run `tapetrain data prepare` into a fresh "
                        "directory") from err
    return _check_manifest(manifest, mpath)


def _check_manifest(manifest: Any, mpath: str) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise DataError(f"{mpath} is not a JSON object; re-run `tapetrain data prepare`")
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{mpath} has format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                        f"this tapetrain reads {FORMAT_NAME!r} version {FORMAT_VERSION}; re-run "
                        "`tapetrain data prepare`")
    if manifest.get("dtype") not in DTYPES:
        raise DataError(f"{mpath} lists dtype {manifest.get('dtype')!r}; expected one of {sorted(DTYPES)}; "
                        "re-run `tapetrain data prepare`")
    return manifest
