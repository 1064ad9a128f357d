"""Evaluation token streams: a flat .bin (LongLoRA layout), a prepared shard directory, or text to tokenize."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tapetrain.data.errors import DataError
from tapetrain.errors import InputError, MissingInputError

log = logging.getLogger("tapetrain.eval")

TOKEN_DTYPES = ("uint16", "uint32")
SPLITS = ("val", "train")


@dataclass
class EvalTokens:
    """A 1-D token stream: read(start, stop) -> int64 ids; `vocab_size` of the tokenizer when the data says."""

    read: Callable[[int, int], np.ndarray]
    num_tokens: int
    description: str
    vocab_size: int | None = None
    tokenizer_sha256: str | None = None  # of the tokenizer that made these ids, when known

    def limited(self, max_tokens: int | None) -> EvalTokens:
        """The first `max_tokens` tokens only (None = all)."""
        if max_tokens is None or max_tokens >= self.num_tokens:
            return self
        if max_tokens < 1:
            raise InputError(f"--max-tokens must be >= 1, got {max_tokens}")
        return EvalTokens(self.read, max_tokens, f"{self.description} (first {max_tokens} tokens)", self.vocab_size,
                          self.tokenizer_sha256)

    def check_tokenizer(self, model_sha256: str | None, model_name: str) -> None:
        """Raise when the data's tokenizer is known, the model's too, and they differ (same vocab size or not)."""
        if self.tokenizer_sha256 and model_sha256 and self.tokenizer_sha256 != model_sha256:
            raise InputError(f"{self.description} was tokenized with a tokenizer of sha256 "
                             f"{self.tokenizer_sha256[:12]}… but {model_name} was trained with sha256 "
                             f"{model_sha256[:12]}…: its token ids mean "
                             "something else to this model. Evaluate data prepared with the model's tokenizer "
                             "(`tapetrain data prepare --tokenizer` with the model's tokenizer, or pass text)")

    def check_vocab(self, model_vocab: int, block: int = 1 << 22) -> None:
        """Raise naming the first id >= the model's vocabulary (scans the stream in blocks)."""
        if self.vocab_size is not None and self.vocab_size > model_vocab:
            raise InputError(f"{self.description} was tokenized with a {self.vocab_size}-token vocabulary but the "
                             f"model has vocab_size={model_vocab}; evaluate with data made by the model's tokenizer")
        for start in range(0, self.num_tokens, block):
            part = self.read(start, min(start + block, self.num_tokens))
            if len(part) and int(part.max()) >= model_vocab:
                pos = start + int(np.argmax(part >= model_vocab))
                raise InputError(f"{self.description} holds token id {int(part.max())} (first bad id at position "
                                 f"{pos}) >= the model's vocab_size={model_vocab}: the data was made with another "
                                 "tokenizer or is read with the wrong --token-dtype")


def _open_shards(path: str, token_dtype: str | None, split: str | None) -> EvalTokens:
    from tapetrain.data.format import load_manifest
    from tapetrain.data.packed import PackedDataset

    manifest = load_manifest(path)
    if token_dtype is not None and token_dtype != manifest["dtype"]:
        raise InputError(f"dtype mismatch: {path}/manifest.json stores {manifest['dtype']} ids but --token-dtype "
                         f"{token_dtype} was given; drop --token-dtype (shard directories know their dtype)")
    has_val = bool(manifest.get("splits", {}).get("val", {}).get("shards"))
    if split is None and not has_val:  # never fall back to training data silently: that is in-sample perplexity
        raise InputError(f"{path} has no val split; pass --split train to evaluate on its training split "
                         "(in-sample perplexity), or re-run `tapetrain data prepare` with --val-fraction F")
    if split == "val" and not has_val:
        raise InputError(f"--split val: {path} has no val split; re-run `tapetrain data prepare` with --val-fraction F "
                         "or pass --split train")
    split = split or "val"
    if split == "train":
        log.warning("evaluating on the TRAINING split of %s: in-sample perplexity, not a held-out score", path)
    data = PackedDataset(path, 1, split=split)
    sha = (manifest.get("tokenizer") or {}).get("sha256")
    return EvalTokens(data.tokens, data.num_tokens, f"{path} ({split} split)", data.vocab_size, sha)


def _open_flat(path: str, token_dtype: str | None) -> EvalTokens:
    from tapetrain.data.flat_tokens import FlatTokenFile

    dtype = token_dtype or "uint16"
    flat = FlatTokenFile(path, np.dtype(dtype))
    tokens = flat.tokens
    return EvalTokens(lambda a, b: np.asarray(tokens[a:b], dtype=np.int64), len(tokens), f"{path} ({dtype})")


def _open_text(path: str, tokenizer: str | None) -> EvalTokens:
    if not tokenizer:
        raise InputError(f"{path} is text and needs a tokenizer: pass --tokenizer PATH (a sentencepiece .model, "
                         "a tokenizer.json or a model directory), "
                         "or evaluate a model whose export/run names one")
    from tapetrain.data.sources import iter_documents
    from tapetrain.data.tokenizer import open_tokenizer

    tok = open_tokenizer(tokenizer)
    ids: list[int] = []
    for doc in iter_documents(path):
        ids.extend(tok.encode(doc.text))
        if tok.eos_id >= 0:
            ids.append(tok.eos_id)  # documents end with EOS, as `tapetrain data prepare` writes them
    array = np.asarray(ids, dtype=np.int64)
    log.info("tokenized %s with %s: %d tokens", path, tokenizer, len(array))
    return EvalTokens(lambda a, b: array[a:b], len(array), f"{path} (tokenized)", tok.vocab_size, tok.checksum)


def open_eval_tokens(
    path: str, *, tokenizer: str | None = None, token_dtype: str | None = None, split: str | None = None
) -> EvalTokens:
    """Open `path`: a directory with manifest.json (its `split`; by default val, and an error naming --split train
    when it has none), a flat .bin of `token_dtype` ids (default uint16, the LongLoRA layout), or any text input
    `tapetrain data prepare` reads."""
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise InputError(f"--token-dtype {token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    if split is not None and split not in SPLITS:
        raise InputError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    from tapetrain.data.remote import is_remote

    if is_remote(path):  # a prepared dataset in object storage: its shards through the node's cache
        try:
            return _open_shards(path, token_dtype, split)
        except DataError as err:
            raise InputError(f"eval data: {err}") from err
    if split is not None and not os.path.isdir(path):
        raise InputError(f"--split applies to shard directories written by `tapetrain data prepare`, not {path}; "
                         "drop it")
    if not os.path.exists(path):
        raise MissingInputError(f"eval data {path} does not exist; pass a flat .bin token file, a `tapetrain "
                                "data prepare` output directory or a text file")
    try:
        if os.path.isdir(path):
            return _open_shards(path, token_dtype, split)
        if path.endswith(".bin"):
            return _open_flat(path, token_dtype)
        return _open_text(path, tokenizer)
    except DataError as err:  # name the problem in the eval's terms but keep the data layer's fix
        raise InputError(f"eval data: {err}") from err
